"""The phase timer's forward hooks: forward time summed over a step's forward passes, and the
thread's wait for a CPU inside them (not the waits between them)."""

from __future__ import annotations

import pytest
import torch

from vigil.agent import phases


class _Clocks:
    """A monotonic clock and a CPU-wait counter the test advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waited = 0.0

    def pass_time(self, seconds: float, *, waiting: float = 0.0) -> None:
        self.now += seconds
        self.waited += waiting


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
    forward_s, _backward_s, _optimizer_s, forward_wait_s = timer.take(clocks.now)
    assert forward_s == pytest.approx(0.020)
    assert forward_wait_s == pytest.approx(0.006)
    assert errors == []
    assert timer.take(clocks.now)[3] == 0.0  # reset for the next step


def test_without_a_cpu_wait_reader_the_forward_wait_is_zero() -> None:
    clocks = _Clocks()
    timer = phases.PhaseTimer(on_error=lambda exc: None, clock=lambda: clocks.now)
    model = _Layer(clocks, 0.010, 0.003)
    timer.watch(model, None)
    model(torch.ones(2))
    assert timer.take(clocks.now)[0] == pytest.approx(0.010)
    assert timer.forward_cpu_wait_s == 0.0
