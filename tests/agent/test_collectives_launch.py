"""Time spent inside the call that launches an asynchronous op is the training thread's
communication time (gloo's p2p sends write their socket there), not compute.

The recorder runs on a fake clock; `patching`'s wrapper wraps stand-in op functions that
advance it, so what is asserted is what the step record's `comm_wait_s` would carry.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vigil.agent import collectives, patching


class _Future:
    def add_done_callback(self, callback: Any) -> None:
        self.callback = callback


class _Work:
    def __init__(self) -> None:
        self.future = _Future()

    def get_future(self) -> _Future:
        return self.future


@pytest.fixture
def clock() -> list[float]:
    return [100.0]


@pytest.fixture
def recorder(clock: list[float]) -> Iterator[collectives.CollectiveRecorder]:
    def fail(exc: BaseException) -> None:
        raise exc

    rec = collectives.CollectiveRecorder(page=None, on_error=fail, clock=lambda: clock[0])
    patching._active = rec
    yield rec
    patching._active = None
    patching._waitable.clear()


def _all_reduce_taking(clock: list[float], seconds: float, works: list[_Work]) -> Any:
    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        clock[0] += seconds  # the call itself takes this long (a socket write, a lost CPU)
        work = _Work()
        works.append(work)
        return work if async_op else None

    return patching._wrap("all_reduce", all_reduce)


def test_an_async_ops_launch_time_counts_as_blocked_and_its_duration_runs_to_completion(
    recorder: collectives.CollectiveRecorder, clock: list[float]
) -> None:
    works: list[_Work] = []
    wrapped = _all_reduce_taking(clock, 0.003, works)
    wrapped(torch.ones(4), async_op=True)
    clock[0] += 0.010  # compute while the op is in flight
    works[0].future.callback(None)  # completes on the comm thread's callback
    aggs, blocked, total = recorder.swap()
    assert blocked == pytest.approx(0.003)  # only the launch: the in-flight time overlaps compute
    ((_, agg),) = aggs.items()
    assert agg.total_s == pytest.approx(0.013) and total == pytest.approx(0.013)


def test_a_launch_on_another_thread_is_not_the_training_threads_time(
    recorder: collectives.CollectiveRecorder, clock: list[float]
) -> None:
    works: list[_Work] = []
    wrapped = _all_reduce_taking(clock, 0.004, works)
    other = threading.Thread(target=lambda: wrapped(torch.ones(4), async_op=True))
    other.start()
    other.join()
    _, blocked, _ = recorder.swap()
    assert blocked == 0.0


def test_a_synchronous_op_is_counted_once(
    recorder: collectives.CollectiveRecorder, clock: list[float]
) -> None:
    wrapped = _all_reduce_taking(clock, 0.005, [])
    wrapped(torch.ones(4))
    _, blocked, _ = recorder.swap()
    assert blocked == pytest.approx(0.005)


def test_a_batch_of_p2p_ops_counts_its_whole_call_once(
    recorder: collectives.CollectiveRecorder, clock: list[float]
) -> None:
    """`batch_isend_irecv` (a pipeline stage's microbatch exchange) launches its ops through
    the wrapped functions: each op is recorded, and the batch's time, its checks included, is
    blocked time once (not once more per op)."""
    works: list[_Work] = []
    op = _all_reduce_taking(clock, 0.002, works)

    def batch_isend_irecv(ops: list[Any]) -> list[Any]:
        clock[0] += 0.001  # the batch's own checks
        return [op(t, async_op=True) for t in ops]

    wrapped = patching._wrap_batch(batch_isend_irecv)
    start = clock[0]
    wrapped([torch.ones(4), torch.ones(4)])
    for work in works:
        work.future.callback(None)
    aggs, blocked, _ = recorder.swap()
    assert blocked == pytest.approx(clock[0] - start) and blocked == pytest.approx(0.005)
    ((_, agg),) = aggs.items()
    assert agg.count == 2
