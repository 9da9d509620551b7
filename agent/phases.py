"""Forward / backward / optimizer phase timing through module and optimizer hooks.

`PhaseTimer.watch(model, optimizer)` installs:
- a forward pre-hook and forward hook on the root module (forward time, summed over micro-batches);
- optimizer step pre/post hooks (optimizer time);
- where the process runs a `torch.distributed.pipelining` schedule, a wrapper of its `step`
  (`schedules.py`: the time inside it, and the CPU and collective waits there) and of its
  stage's backward passes (their time, and the same waits there).
Backward is the time from the end of a forward whose output needs gradients to the optimizer
step, the next forward or the step's end, whichever comes first: it includes the loss
computation. (A per-forward hook on the output's gradient would exclude the loss but costs the
training thread more than all the other hooks together; on GPUs, where these CPU-side
timestamps mark launches, the two differ by the loss's launch time only.)

The forward hooks also read the thread's CPU wait (`cpu_wait`, a callable: `cpuwait.py`'s one
`pread`, ~1.5 µs) and sum the part of it inside forward passes: the analyzer takes that, not the
whole step's wait, out of a forward pass's growth (`analyzer/forward_shift.py`).

Hooks only read a monotonic clock and add to floats; they never raise into training (errors are
counted through `on_error`). No I/O beyond that read, no torch.distributed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vigil.agent import schedules


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values: Any = output.values() if isinstance(output, dict) else output
    if isinstance(values, list | tuple) or hasattr(values, "__iter__"):
        for item in values:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return item
    return None


class PhaseSums(NamedTuple):
    """One step's phase times (seconds)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    forward_cpu_wait_s: float  # the thread's wait for a CPU inside forward passes
    pipeline_s: float  # inside pipeline schedules' `step`
    pipeline_cpu_wait_s: float  # ... waiting for a CPU in there
    pipeline_comm_wait_s: float  # ... blocked in collectives in there (the recorder's time)
    stage_backward_s: float  # inside a pipeline stage's backward passes
    stage_backward_wait_s: float  # ... waiting for a CPU or blocked in collectives in there


class _Inside:
    """Time inside calls of one kind (a nested call counts once), and of it the thread's CPU
    wait and its time blocked in collectives (the recorder's, which restarts at 0 after each
    step's `take`). Per step; a call still running at the step's end counts up to it and on
    from there in the next step."""

    __slots__ = (
        "_blocked",
        "_blocked_start",
        "_clock",
        "_cpu_wait",
        "_start",
        "_wait_start",
        "comm_wait_s",
        "cpu_wait_s",
        "depth",
        "seconds",
    )

    def __init__(
        self,
        clock: Callable[[], float],
        cpu_wait: Callable[[], float] | None,
        blocked: Callable[[], float] | None,
    ) -> None:
        self._clock, self._cpu_wait, self._blocked = clock, cpu_wait, blocked
        self.depth = 0
        self._start = self._wait_start = self._blocked_start = 0.0
        self.reset()

    def reset(self) -> None:
        self.seconds = self.cpu_wait_s = self.comm_wait_s = 0.0

    def enter(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self._start = self._clock()
            if self._cpu_wait is not None:
                self._wait_start = self._cpu_wait()
            if self._blocked is not None:
                self._blocked_start = self._blocked()

    def leave(self) -> None:
        if self.depth <= 0:  # its enter failed
            return
        self.depth -= 1
        if self.depth == 0:
            self.add(self._clock())

    def add(self, now: float) -> None:
        """Count the open call up to `now` (at its end, or at a step's end inside it)."""
        self.seconds += max(0.0, now - self._start)
        self._start = now
        if self._cpu_wait is not None:
            waited = self._cpu_wait()
            self.cpu_wait_s += max(0.0, waited - self._wait_start)
            self._wait_start = waited
        if self._blocked is not None:
            blocked = self._blocked()
            self.comm_wait_s += max(0.0, blocked - self._blocked_start)
            self._blocked_start = 0.0 if self.depth else blocked  # the recorder restarts at 0


class PhaseTimer:
    """Per-step sums of forward, backward and optimizer seconds for one watched model."""

    def __init__(
        self,
        *,
        on_error: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
        cpu_wait: Callable[[], float] | None = None,
        comm_blocked: Callable[[], float] | None = None,
    ) -> None:
        self._clock = clock
        self._cpu_wait = cpu_wait
        self._on_error = on_error
        self._handles: list[Any] = []
        self._pipelined = False  # this timer's `schedules.install` took
        # Inside pipeline schedules' `step` and inside the stage's backward passes
        # (`schedules.py`): the stage's waits for its peers are in the first, not the second.
        # `comm_blocked`: the step's blocked time in collectives so far.
        self.pipeline = _Inside(clock, cpu_wait, comm_blocked)
        self.stage_backward = _Inside(clock, cpu_wait, comm_blocked)
        self.reset()

    def reset(self) -> None:
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.optimizer_s = 0.0
        self.forward_cpu_wait_s = 0.0  # the thread's wait for a CPU inside forward passes
        self.pipeline.reset()
        self.stage_backward.reset()
        self._forward_wait_start = 0.0
        self._forward_start: float | None = None
        self._backward_start: float | None = None
        self._optimizer_start: float | None = None

    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._pipelined = schedules.install(self) or self._pipelined
        self._handles.append(model.register_forward_pre_hook(self._pre_forward))
        self._handles.append(model.register_forward_hook(self._post_forward))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_optimizer))
            self._handles.append(optimizer.register_step_post_hook(self._post_optimizer))

    def remove(self) -> None:
        if self._pipelined:
            schedules.uninstall(self)
            self._pipelined = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def end_backward(self, now: float | None = None) -> None:
        """Close an open backward phase (called at optimizer start, next forward, step end)."""
        if self._backward_start is not None:
            now = self._clock() if now is None else now
            self.backward_s += max(0.0, now - self._backward_start)
            self._backward_start = None

    def take(self, now: float | None = None) -> PhaseSums:
        """The sums of the step that just ended (at `now`); resets them. A schedule still
        running (a step boundary inside it) counts up to `now` and on from there in the next
        step (call before the recorder's `swap`, which restarts its blocked time)."""
        self.end_backward(now)
        pipeline, backward = self.pipeline, self.stage_backward
        if pipeline.depth or backward.depth:  # a step boundary inside a schedule
            now = self._clock() if now is None else now
            for inside in (pipeline, backward):
                if inside.depth > 0:
                    inside.add(now)
        sums = PhaseSums(
            self.forward_s,
            self.backward_s,
            self.optimizer_s,
            self.forward_cpu_wait_s,
            pipeline.seconds,
            pipeline.cpu_wait_s,
            pipeline.comm_wait_s,
            backward.seconds,
            backward.cpu_wait_s + backward.comm_wait_s,
        )
        self.reset()
        return sums

    # -- hooks (fail-open) ----------------------------------------------------------------
    def enter_pipeline(self) -> None:
        """A pipeline schedule's `step` begins (`schedules.py`; nested calls count once)."""
        self._enter(self.pipeline)

    def leave_pipeline(self) -> None:
        self._leave(self.pipeline)

    def enter_stage_backward(self) -> None:
        """A pipeline stage's backward pass of one chunk begins (`schedules.py`)."""
        self._enter(self.stage_backward)

    def leave_stage_backward(self) -> None:
        self._leave(self.stage_backward)

    def _enter(self, inside: _Inside) -> None:
        try:
            inside.enter()
        except Exception as exc:
            self._on_error(exc)

    def _leave(self, inside: _Inside) -> None:
        try:
            inside.leave()
        except Exception as exc:
            self._on_error(exc)

    def _pre_forward(self, _module: Any, _args: Any) -> None:
        try:
            now = self._clock()
            self.end_backward(now)
            self._forward_start = now
            if self._cpu_wait is not None:
                self._forward_wait_start = self._cpu_wait()
        except Exception as exc:
            self._on_error(exc)

    def _post_forward(self, _module: Any, _args: Any, output: Any) -> None:
        try:
            now = self._clock()
            if self._forward_start is not None:
                self.forward_s += now - self._forward_start
                self._forward_start = None
                if self._cpu_wait is not None:
                    waited = self._cpu_wait() - self._forward_wait_start
                    self.forward_cpu_wait_s += max(0.0, waited)
            if torch.is_grad_enabled() and _first_grad_tensor(output) is not None:
                self._backward_start = now
        except Exception as exc:
            self._on_error(exc)

    def _pre_optimizer(self, *_args: Any) -> None:
        try:
            now = self._clock()
            self.end_backward(now)
            self._optimizer_start = now
        except Exception as exc:
            self._on_error(exc)

    def _post_optimizer(self, *_args: Any) -> None:
        try:
            if self._optimizer_start is not None:
                self.optimizer_s += self._clock() - self._optimizer_start
                self._optimizer_start = None
        except Exception as exc:
            self._on_error(exc)
