"""The training thread's wait for a CPU, read from Linux's per-thread schedstat, reaches the
step record: near zero on an idle core, the time a competing process held the core otherwise.

The contention is real: a busy child process pinned to the core this thread is pinned to, while
the thread spins through a step. The kernel then shares the core between them, so the thread
waits for about half the step.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import vigil.agent
from vigil import codec, schema
from vigil.agent import cpuwait

pytestmark = [
    pytest.mark.skipif(
        not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat"
    ),
    pytest.mark.serial,  # "near zero on an idle core": no other test may share it
]


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds  # CPU seconds: the spin does the same work either way
    while time.thread_time() < end:
        pass


@pytest.fixture
def one_core() -> Iterator[int]:
    """This thread pinned to one core (restored after)."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    yield core
    os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _hog(core: int) -> Iterator[None]:
    """A busy process pinned to `core` while the block runs."""
    code = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def _init(tmp_path: Path, job: str) -> None:
    vigil.agent.init(
        job=job,
        output_dir=tmp_path / "out",
        progress_dir=tmp_path / "pages",
        rank=0,
        world_size=1,
        measure_cpu_peak=False,
        flush_interval_s=0.05,
    )


def _steps(tmp_path: Path, job: str) -> dict[int, schema.StepRecord]:
    path = tmp_path / "out" / job / "rank-00000.jsonl"
    records = [codec.decode_json(line) for line in path.read_bytes().splitlines()]
    return {r.step: r for r in records if isinstance(r, schema.StepRecord)}


def test_the_wait_grows_only_while_another_process_holds_the_core(one_core: int) -> None:
    wait = cpuwait.ThreadCpuWait()
    start = wait.read()
    _spin(0.2)
    alone = wait.read() - start
    with _hog(one_core):
        time.sleep(0.2)  # the hog is running
        start = wait.read()
        _spin(0.3)
        shared = wait.read() - start
    wait.close()
    assert alone < 0.05
    assert shared > 0.1  # about 0.3 s: the hog's half of the core while this thread spun


def test_a_read_from_another_thread_reads_that_thread(one_core: int) -> None:
    wait = cpuwait.ThreadCpuWait()
    main = wait.read()
    seen: list[float] = []
    thread = threading.Thread(target=lambda: seen.append(wait.read()))
    thread.start()
    thread.join()
    assert seen and seen[0] <= main + 0.05  # a fresh thread has waited next to nothing
    wait.close()


def test_without_schedstat_the_wait_is_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpuwait, "_PATH", "/proc/thread-self/no-such-file")
    wait = cpuwait.ThreadCpuWait()
    assert (wait.read(), wait.available) == (0.0, False)


def test_the_step_record_carries_the_steps_cpu_wait(tmp_path: Path, one_core: int) -> None:
    _init(tmp_path, "cpuwait")
    try:
        with vigil.agent.step(0):
            _spin(0.2)
        with _hog(one_core):
            time.sleep(0.2)
            with vigil.agent.step(1):
                _spin(0.3)
    finally:
        vigil.agent.shutdown()
    steps = _steps(tmp_path, "cpuwait")
    assert steps[0].cpu_wait_s < 0.05
    assert 0.1 < steps[1].cpu_wait_s < steps[1].step_time_s


def test_a_wait_between_steps_is_not_the_next_steps(tmp_path: Path, one_core: int) -> None:
    """The training thread waits for the core between two steps (a busy process shares it
    while the loop does other work): the next step, run alone, carries none of that wait."""
    _init(tmp_path, "cpuwait-gap")
    try:
        with vigil.agent.step(0):
            _spin(0.05)
        with _hog(one_core):
            _spin(0.3)  # between the steps, sharing the core
        with vigil.agent.step(1):
            _spin(0.2)
    finally:
        vigil.agent.shutdown()
    steps = _steps(tmp_path, "cpuwait-gap")
    assert steps[1].cpu_wait_s < 0.05


class _CountingWait:
    """Stands in for the session's `ThreadCpuWait`: 1 ms more wait at every read."""

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> float:
        self.reads += 1
        return self.reads * 0.001


def test_back_to_back_steps_read_schedstat_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vigil.agent import sdk
    from vigil.agent import session as session_module

    # Steps within the gap of each other (a wide one here: the flusher thread may take the GIL
    # between two steps of this loop for longer than the default's half millisecond).
    monkeypatch.setattr(session_module, "CPU_WAIT_GAP_S", 10.0)
    _init(tmp_path, "cpuwait-reads")
    session = sdk._session
    assert session is not None
    counter = _CountingWait()
    session._cpu_wait = counter  # type: ignore[assignment]
    try:
        for i in range(5):
            with vigil.agent.step(i):
                pass
    finally:
        vigil.agent.shutdown()
    assert counter.reads == 6  # the first step's start, then each step's end
    waits = [r.cpu_wait_s for r in _steps(tmp_path, "cpuwait-reads").values()]
    assert waits == pytest.approx([0.001] * 5)  # each step: one read's worth, none counted twice


class _Spinning(torch.nn.Module):
    """A watched model whose forward pass spins for `seconds` of CPU."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _spin(self.seconds)
        return x


def test_the_step_record_carries_the_part_of_the_wait_inside_forward_passes(
    tmp_path: Path, one_core: int
) -> None:
    """Step 0 shares the core in its forward pass, step 1 only after it: the step's wait is
    about the same, the forward pass's is not."""
    _init(tmp_path, "cpuwait-forward")
    model = _Spinning(0.3)
    vigil.agent.watch(model)
    try:
        with _hog(one_core):
            time.sleep(0.2)
            with vigil.agent.step(0):
                model(torch.ones(1))
        model.seconds = 0.05
        with vigil.agent.step(1):
            model(torch.ones(1))
            with _hog(one_core):
                time.sleep(0.2)
                _spin(0.3)
    finally:
        vigil.agent.shutdown()
    steps = _steps(tmp_path, "cpuwait-forward")
    assert 0.1 < steps[0].forward_cpu_wait_s <= steps[0].cpu_wait_s
    assert steps[1].cpu_wait_s > 0.1
    assert steps[1].forward_cpu_wait_s < 0.05
