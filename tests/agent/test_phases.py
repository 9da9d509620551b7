"""The phase timer's forward hooks: forward time summed over a step's forward passes, and the
thread's wait for a CPU inside them (not the waits between them); and its time inside pipeline
schedules' `step`, with the waits in there (the real schedules' path runs in
tests/realjobs/test_detection.py)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import pytest
import torch

from vigil.agent import phases, schedules


class _Clocks:
    """A monotonic clock and a CPU-wait counter the test advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waited = 0.0
        self.blocked = 0.0  # in collectives, as the recorder counts it

    def pass_time(self, seconds: float, *, waiting: float = 0.0, blocked: float = 0.0) -> None:
        self.now += seconds
        self.waited += waiting
        self.blocked += blocked

    def timer(self, on_error: Callable[[BaseException], None]) -> phases.PhaseTimer:
        """A phase timer that reads these clocks."""
        return phases.PhaseTimer(
            on_error=on_error,
            clock=lambda: self.now,
            cpu_wait=lambda: self.waited,
            comm_blocked=lambda: self.blocked,
        )


class _Layer(torch.nn.Module):
    def __init__(self, clocks: _Clocks, seconds: float, waiting: float) -> None:
        super().__init__()
        self.clocks, self.seconds, self.waiting = clocks, seconds, waiting
        self.weight = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clocks.pass_time(self.seconds, waiting=self.waiting)
        return x * self.weight


def test_the_cpu_wait_inside_forward_passes_is_summed_and_none_outside() -> None:
    clocks = _Clocks()
    errors: list[BaseException] = []
    timer = phases.PhaseTimer(
        on_error=errors.append, clock=lambda: clocks.now, cpu_wait=lambda: clocks.waited
    )
    model = _Layer(clocks, 0.010, 0.003)  # each forward: 10 ms, 3 ms of it waiting for a CPU
    timer.watch(model, None)
    for _ in range(2):  # two micro-batches
        clocks.pass_time(0.020, waiting=0.007)  # between them (a receive, data): not forward's
        model(torch.ones(2)).sum().backward()
    clocks.pass_time(0.005, waiting=0.001)
    sums = timer.take(clocks.now)
    assert sums.forward_s == pytest.approx(0.020)
    assert sums.forward_cpu_wait_s == pytest.approx(0.006)
    assert errors == []
    assert timer.take(clocks.now).forward_cpu_wait_s == 0.0  # reset for the next step
    timer.remove()


def test_without_a_cpu_wait_reader_the_forward_wait_is_zero() -> None:
    clocks = _Clocks()
    timer = phases.PhaseTimer(on_error=lambda exc: None, clock=lambda: clocks.now)
    model = _Layer(clocks, 0.010, 0.003)
    timer.watch(model, None)
    model(torch.ones(2))
    assert timer.take(clocks.now).forward_s == pytest.approx(0.010)
    assert timer.forward_cpu_wait_s == 0.0
    timer.remove()


def _pipeline_module(clocks: _Clocks) -> types.ModuleType:
    """A stand-in for torch.distributed.pipelining.schedules: its two schedule bases, whose
    `step` passes 30 ms (5 of them waiting for a CPU, 12 blocked receiving from a peer), and a
    schedule whose own `step` calls its base's (counted once)."""
    module = types.ModuleType(schedules._MODULE)

    class PipelineScheduleSingle:
        def step(self) -> str:
            clocks.pass_time(0.030, waiting=0.005, blocked=0.012)
            return "stepped"

    class PipelineScheduleMulti(PipelineScheduleSingle):
        def step(self) -> str:
            return super().step()

    module.PipelineScheduleSingle = PipelineScheduleSingle  # type: ignore[attr-defined]
    module.PipelineScheduleMulti = PipelineScheduleMulti  # type: ignore[attr-defined]
    return module


def test_time_inside_pipeline_schedules_and_their_waits_are_summed_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks = _Clocks()
    module = _pipeline_module(clocks)
    monkeypatch.setitem(sys.modules, schedules._MODULE, module)
    original = module.PipelineScheduleSingle.step
    errors: list[BaseException] = []
    timer = clocks.timer(errors.append)
    timer.watch(_Layer(clocks, 0.0, 0.0), None)
    clocks.pass_time(0.010, waiting=0.002, blocked=0.001)  # data, outside any schedule
    assert module.PipelineScheduleSingle().step() == "stepped"
    assert module.PipelineScheduleMulti().step() == "stepped"  # nested: counted once
    clocks.pass_time(0.004, blocked=0.003)  # e.g. a gradient norm's all-reduce, outside
    sums = timer.take(clocks.now)
    assert sums.pipeline_s == pytest.approx(0.060)
    assert sums.pipeline_cpu_wait_s == pytest.approx(0.010)
    assert sums.pipeline_comm_wait_s == pytest.approx(0.024)
    assert errors == []
    assert timer.take(clocks.now).pipeline_s == 0.0  # reset for the next step
    timer.remove()  # the schedules are theirs again
    assert module.PipelineScheduleSingle.step is original
    module.PipelineScheduleSingle().step()
    assert timer.take(clocks.now).pipeline_s == 0.0


def test_a_step_boundary_inside_a_schedule_splits_its_time_between_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks = _Clocks()
    monkeypatch.setitem(sys.modules, schedules._MODULE, _pipeline_module(clocks))
    timer = phases.PhaseTimer(
        on_error=lambda exc: None, clock=lambda: clocks.now, comm_blocked=lambda: clocks.blocked
    )
    timer.watch(_Layer(clocks, 0.0, 0.0), None)
    timer.enter_pipeline()
    clocks.pass_time(0.020, blocked=0.008)
    first = timer.take(clocks.now)
    clocks.blocked = 0.0  # the recorder's swap starts the next step's blocked time
    clocks.pass_time(0.005, blocked=0.002)
    timer.leave_pipeline()
    second = timer.take(clocks.now)
    assert (first.pipeline_s, first.pipeline_comm_wait_s) == pytest.approx((0.020, 0.008))
    assert (second.pipeline_s, second.pipeline_comm_wait_s) == pytest.approx((0.005, 0.002))
    timer.remove()


def test_without_pipelining_imported_nothing_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, schedules._MODULE, raising=False)
    timer = phases.PhaseTimer(on_error=lambda exc: None)
    assert schedules.install(timer) is False
    timer.watch(_Layer(_Clocks(), 0.0, 0.0), None)
    assert timer.take().pipeline_s == 0.0
    timer.remove()


def test_schedules_left_wrapped_by_an_earlier_timer_do_not_stop_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A timer never removed (a session that did not shut down) leaves its schedules wrapped:
    a later timer still wraps the schedule classes it finds, and times them."""
    clocks = _Clocks()
    earlier = _pipeline_module(clocks)
    monkeypatch.setitem(sys.modules, schedules._MODULE, earlier)
    stale = phases.PhaseTimer(on_error=lambda exc: None, clock=lambda: clocks.now)
    stale.watch(_Layer(clocks, 0.0, 0.0), None)  # never removed
    later = _pipeline_module(clocks)
    monkeypatch.setitem(sys.modules, schedules._MODULE, later)
    timer = phases.PhaseTimer(on_error=lambda exc: None, clock=lambda: clocks.now)
    timer.watch(_Layer(clocks, 0.0, 0.0), None)
    later.PipelineScheduleSingle().step()
    earlier.PipelineScheduleSingle().step()  # still wrapped: it times for the active timer
    assert timer.take(clocks.now).pipeline_s == pytest.approx(0.060)
    assert stale.take(clocks.now).pipeline_s == 0.0
    timer.remove()  # restores both modules' schedules
    assert not hasattr(later.PipelineScheduleSingle.step, "__vigil_timed__")
    assert not hasattr(earlier.PipelineScheduleSingle.step, "__vigil_timed__")


def _stage_module(clocks: _Clocks) -> types.ModuleType:
    """A stand-in for torch.distributed.pipelining.stage: its stage base, whose backward of
    one chunk passes 8 ms (1 of them waiting for a CPU, 2 blocked in a gradient all-reduce)
    and whose weight-gradient backward of one chunk passes 3 ms."""
    module = types.ModuleType(schedules._STAGE_MODULE)

    class _PipelineStageBase:
        def backward_one_chunk(self, chunk: int, loss: object = None) -> int:
            clocks.pass_time(0.008, waiting=0.001, blocked=0.002)
            return chunk

        def backward_weight_one_chunk(self, chunk: int) -> int:
            clocks.pass_time(0.003)
            return chunk

    module._PipelineStageBase = _PipelineStageBase  # type: ignore[attr-defined]
    return module


def test_a_stages_backward_passes_and_their_waits_are_summed_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside the schedule the stage receives a chunk's gradients (a wait for its peers)
    before the chunk's backward runs: only the backward calls count, with their own waits."""
    clocks = _Clocks()
    monkeypatch.setitem(sys.modules, schedules._MODULE, _pipeline_module(clocks))
    stage_module = _stage_module(clocks)
    monkeypatch.setitem(sys.modules, schedules._STAGE_MODULE, stage_module)
    base = stage_module._PipelineStageBase
    original = base.backward_one_chunk
    errors: list[BaseException] = []
    timer = clocks.timer(errors.append)
    timer.watch(_Layer(clocks, 0.0, 0.0), None)
    stage = base()
    for chunk in range(2):
        clocks.pass_time(0.010, waiting=0.002, blocked=0.006)  # receiving its gradients
        assert stage.backward_one_chunk(chunk, loss=None) == chunk
        assert stage.backward_weight_one_chunk(chunk) == chunk
    sums = timer.take(clocks.now)
    assert sums.stage_backward_s == pytest.approx(0.022)
    assert sums.stage_backward_wait_s == pytest.approx(0.006)
    assert errors == []
    assert timer.take(clocks.now).stage_backward_s == 0.0  # reset for the next step
    timer.remove()  # the stage's methods are its own again
    assert base.backward_one_chunk is original
    stage.backward_one_chunk(0)
    assert timer.take(clocks.now).stage_backward_s == 0.0
