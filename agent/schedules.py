"""Time inside `torch.distributed.pipelining`'s schedules: a pipeline stage's waits are in there.

A pipeline stage waits for its peers only inside its schedule's `step` (the schedule receives
activations and gradients there, and waits for its sends to drain before it returns). Time
outside it (data loading, the optimizer step, the rest of the user's loop) is the stage's own:
a stage slowed there starts its next schedule late, and its peers wait for it inside theirs,
while its own time outside grows. The analyzer compares that time with the stage's own earlier
steps (`analyzer/forward_shift.py`): it finds a stage slowed after its optimizer step, which
neither its forward time nor its waits show.

`install(timer)` wraps `step` of the two schedule bases (`PipelineScheduleSingle`: 1F1B, GPipe;
`PipelineScheduleMulti`: interleaved, zero-bubble, DualPipeV) so that each call is timed by
`PhaseTimer.enter_pipeline` / `leave_pipeline` (a nested call, a schedule whose own `step`
calls its base's, counts once). Only where the user's process has imported the pipelining
module already (watch the stage after building its schedule): the SDK never imports it itself.
The wrappers are fail-open and pass through while no timer is installed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol

_MODULE = "torch.distributed.pipelining.schedules"
_BASES = ("PipelineScheduleSingle", "PipelineScheduleMulti")


class Timer(Protocol):
    def enter_pipeline(self) -> None: ...

    def leave_pipeline(self) -> None: ...


_active: Timer | None = None
_originals: dict[type, Callable[..., Any]] = {}  # a wrapped class -> its own `step`


def install(timer: Timer) -> bool:
    """Time `timer`'s schedule steps from now on; False where pipelining is not imported."""
    global _active
    module = sys.modules.get(_MODULE)
    if module is None:
        return False
    _active = timer
    for name in _BASES:
        cls = getattr(module, name, None)
        if not isinstance(cls, type):
            continue
        original = cls.__dict__.get("step")
        if original is None or getattr(original, _MARK, False):  # none, or wrapped already
            continue
        _originals[cls] = original
        cls.step = _timed(original)  # type: ignore[attr-defined]
    return True


def uninstall(timer: Timer) -> None:
    """Stop timing for `timer` (another session's timer stays) and restore the schedules."""
    global _active
    if _active is not timer:
        return
    _active = None
    for cls, original in _originals.items():
        cls.step = original  # type: ignore[attr-defined]
    _originals.clear()


_MARK = "__vigil_timed__"


def _timed(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def timed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        timer = _active
        if timer is None:
            return step(self, *args, **kwargs)
        timer.enter_pipeline()  # fail-open: PhaseTimer's hooks never raise
        try:
            return step(self, *args, **kwargs)
        finally:
            timer.leave_pipeline()

    setattr(timed_step, _MARK, True)
    return timed_step
