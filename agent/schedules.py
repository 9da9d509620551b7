"""Time inside `torch.distributed.pipelining`'s schedules: a pipeline stage's waits are in there.

A pipeline stage waits for its peers only inside its schedule's `step` (the schedule receives
activations and gradients there, and waits for its sends to drain before it returns). Time
outside it (data loading, the optimizer step, the rest of the user's loop) is the stage's own:
a stage slowed there starts its next schedule late, and its peers wait for it inside theirs,
while its own time outside grows. The analyzer compares that time with the stage's own earlier
steps (`analyzer/forward_shift.py`): it finds a stage slowed after its optimizer step, which
neither its forward time nor its waits show.

A stage slowed inside its schedule, in its backward passes (a slow layer), makes its peers wait
inside theirs too, and the time inside the schedule holds those waits. Its backward passes
alone do not: the schedule receives a chunk's gradients before it runs the chunk's backward
(`_PipelineStageBase.backward_one_chunk`; zero-bubble schedules split off the weight gradients,
`backward_weight_one_chunk`). Their time is the stage's own backward compute, compared with its
own earlier steps as its forward time is.

`install(timer)` wraps `step` of the two schedule bases (`PipelineScheduleSingle`: 1F1B, GPipe;
`PipelineScheduleMulti`: interleaved, zero-bubble, DualPipeV) so that each call is timed by
`PhaseTimer.enter_pipeline` / `leave_pipeline` (a nested call, a schedule whose own `step`
calls its base's, counts once), and the stage base's two backward methods, timed by
`enter_stage_backward` / `leave_stage_backward`. Only where the user's process has imported the
pipelining module already (watch the stage after building its schedule): the SDK never imports
it itself. The wrappers are fail-open and pass through while no timer is installed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol

_MODULE = "torch.distributed.pipelining.schedules"
_BASES = ("PipelineScheduleSingle", "PipelineScheduleMulti")
_STAGE_MODULE = "torch.distributed.pipelining.stage"
_STAGE_BASE = "_PipelineStageBase"
_BACKWARDS = ("backward_one_chunk", "backward_weight_one_chunk")
_MARK = "__vigil_timed__"  # on a wrapper: the class's method is wrapped already


class Timer(Protocol):
    def enter_pipeline(self) -> None: ...

    def leave_pipeline(self) -> None: ...

    def enter_stage_backward(self) -> None: ...

    def leave_stage_backward(self) -> None: ...


_active: Timer | None = None
# A wrapped (class, method name) -> the class's own method.
_originals: dict[tuple[type, str], Callable[..., Any]] = {}


def install(timer: Timer) -> bool:
    """Time `timer`'s schedule steps from now on; False where pipelining is not imported."""
    global _active
    module = sys.modules.get(_MODULE)
    if module is None:
        return False
    _active = timer
    for name in _BASES:
        _wrap(getattr(module, name, None), "step", _timed_step)
    stage = getattr(sys.modules.get(_STAGE_MODULE), _STAGE_BASE, None)
    for name in _BACKWARDS:
        _wrap(stage, name, _timed_backward)
    return True


def _wrap(cls: Any, name: str, timed: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if not isinstance(cls, type):
        return
    original = cls.__dict__.get(name)
    if original is None or getattr(original, _MARK, False):  # none, or wrapped already
        return
    _originals[(cls, name)] = original
    setattr(cls, name, timed(original))


def uninstall(timer: Timer) -> None:
    """Stop timing for `timer` (another session's timer stays) and restore the schedules."""
    global _active
    if _active is not timer:
        return
    _active = None
    for (cls, name), original in _originals.items():
        setattr(cls, name, original)
    _originals.clear()


def _timed_by(enter: str, leave: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper of a method whose calls the active timer's `enter` and `leave` hooks time."""

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            timer = _active
            if timer is None:
                return method(self, *args, **kwargs)
            getattr(timer, enter)()  # fail-open: PhaseTimer's hooks never raise
            try:
                return method(self, *args, **kwargs)
            finally:
                getattr(timer, leave)()

        setattr(timed_method, _MARK, True)
        return timed_method

    return timed


_timed_step = _timed_by("enter_pipeline", "leave_pipeline")
_timed_backward = _timed_by("enter_stage_backward", "leave_stage_backward")
