"""The progress page: what the SDK writes is what the agent reads, including the ring buffer."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import pytest
import torch

from vigil import schema
from vigil.agent import progress


def _writer(tmp_path: Path, capacity: int = 16) -> progress.PageWriter:
    return progress.PageWriter(
        progress.page_path(tmp_path, "job", 3, "run-1"),
        job="job",
        node="n1",
        rank=3,
        world_size=8,
        local_rank=1,
        capacity=capacity,
    )


def _event(writer: progress.PageWriter, index: int, *, end: float = 2.0) -> None:
    writer.write_event(
        index,
        seq=index + 1,
        step=index // 4,
        nbytes=1024 * (index + 1),
        enqueue_s=1.0,
        start_s=1.0,
        end_s=end,
        group="tp:2",
        op="all_reduce",
        dtype="bfloat16",
    )


def test_snapshot_reads_what_the_writer_wrote(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    reader = progress.PageReader(writer.path)
    first = reader.snapshot()
    assert (first.job, first.node, first.rank, first.world_size, first.local_rank) == (
        "job",
        "n1",
        3,
        8,
        1,
    )
    assert first.state is schema.RankState.STARTING and first.last_step == -1
    writer.progress(schema.RankState.COMPUTE, now_mono=10.0, now_wall=1e9, step=7)
    _event(writer, 0, end=0.0)
    writer.collective("tp:2", 1, "all_reduce", entering=True, now_mono=11.0, now_wall=1e9 + 1)
    snap = reader.snapshot()
    assert snap.state is schema.RankState.IN_COLLECTIVE
    assert (snap.last_step, snap.last_group, snap.last_seq, snap.last_op) == (
        7,
        "tp:2",
        1,
        "all_reduce",
    )
    assert snap.progress_mono_s == 11.0 and snap.step_start_mono_s == 10.0 and snap.ring_head == 1
    writer.step_done(step=7, step_time_s=0.5, mfu=0.4, tokens=64)
    writer.health(progress.Health(internal_errors=2, dropped_records=5))
    snap = reader.snapshot()
    assert (snap.last.step, snap.last.step_time_s, snap.last.mfu, snap.last.tokens) == (
        7,
        0.5,
        0.4,
        64,
    )
    assert math.isnan(snap.last.loss)
    assert (snap.health.internal_errors, snap.health.dropped_records) == (2, 5)
    reader.close()
    writer.close()


def test_ring_keeps_the_newest_events_in_order_and_fills_in_completions(tmp_path: Path) -> None:
    writer = _writer(tmp_path, capacity=16)
    for index in range(40):
        _event(writer, index, end=0.0)
    writer.collective("tp:2", 40, "all_reduce", entering=False, now_mono=1.0, now_wall=1.0)
    writer.finish_event(39, 5.5)
    writer.finish_event(3, 9.9)  # overwritten long ago: must not corrupt the slot now there
    reader = progress.PageReader(writer.path)
    events = reader.events()
    assert [e.seq for e in events] == list(range(25, 41))
    assert events[-1].end_s == 5.5 and all(e.end_s == 0.0 for e in events[:-1])
    assert events[0].bytes == 1024 * 25 and events[0].dtype == "bfloat16"
    assert {e.rank for e in events} == {3} and {e.job_id for e in events} == {"job"}


def test_control_request_round_trip(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    reader = progress.PageReader(writer.path)
    assert writer.control() == (0, "")
    assert reader.request_control("checkpoint") == 1
    assert writer.control() == (1, "checkpoint")
    writer.ack(1)
    assert reader.acked() == 1
    with pytest.raises(ValueError, match=r"1\.\.16 bytes"):
        reader.request_control("x" * 17)


def test_reader_refuses_a_file_that_is_not_a_page(tmp_path: Path) -> None:
    bogus = tmp_path / "job" / "run-1" / "rank-00000.page"
    bogus.parent.mkdir(parents=True)
    bogus.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not a vigil progress page"):
        progress.PageReader(bogus)
    assert progress.discover(tmp_path) == [bogus]


def test_reads_are_consistent_while_another_thread_writes(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    reader = progress.PageReader(writer.path)
    stop = threading.Event()

    def write() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            writer.step_done(step=step, step_time_s=2.0 * step, tokens=step)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads constantly, also in the middle of a write
    thread = threading.Thread(target=write)
    thread.start()
    try:
        seen = [reader.snapshot().last for _ in range(3000)]
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
    # Never a torn block: every reading pairs a step with its own time and tokens.
    assert all(s.step_time_s == 2.0 * s.step and s.tokens == s.step for s in seen if s.step > 0)
    assert len({s.step for s in seen}) > 3  # the writer really ran during the reads


class _Work:
    """A launched asynchronous op whose wait we can watch from inside."""

    def __init__(self, on_wait: object) -> None:
        self.future: torch.futures.Future[None] = torch.futures.Future()
        self.on_wait = on_wait

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def wait(self) -> bool:
        self.on_wait()  # type: ignore[operator]
        return True


def test_blocking_in_an_async_ops_wait_shows_the_rank_in_that_collective(tmp_path: Path) -> None:
    """FSDP2 and DTensor launch collectives asynchronously and block later in Work.wait or
    wait_tensor: the page must say the rank is in that collective (a hang then names the rank
    it waits for, not this one)."""
    from vigil.agent import collectives, patching

    writer = _writer(tmp_path)
    reader = progress.PageReader(writer.path)
    recorder = collectives.CollectiveRecorder(page=writer, on_error=print)
    recorder.step = 5
    pending = recorder.begin("all_gather_single", None, torch.ones(4), None, blocking=False)
    writer.progress(schema.RankState.COMPUTE, now_mono=1.0, now_wall=1e9, step=5)
    seen: list[progress.PageSnapshot] = []
    work = _Work(lambda: seen.append(reader.snapshot()))
    patching._on_completion(recorder, pending, work)
    wait = patching._wrap_wait(_Work.wait)
    patching._active = recorder
    try:
        wait(work)
    finally:
        patching._active = None
    inside, after = seen[0], reader.snapshot()
    assert inside.state is schema.RankState.IN_COLLECTIVE
    assert (inside.last_group, inside.last_seq, inside.last_op) == (
        "world",
        pending.seq,
        "all_gather_single",
    )
    assert after.state is schema.RankState.COMPUTE
    work.future.set_result(None)  # completion forgets the op: a later wait marks nothing
    assert id(work) not in patching._waitable


def test_the_step_boundary_calls_write_what_progress_and_step_done_write(tmp_path: Path) -> None:
    """`step_begun` / `step_ended` (the SDK's positional hot path) leave the page as the
    keyword calls they stand for do."""
    fast, slow = _writer(tmp_path / "fast"), _writer(tmp_path / "slow")
    fast.step_begun(4, 10.0, 1e9)
    slow.progress(schema.RankState.COMPUTE, now_mono=10.0, now_wall=1e9, step=4)
    fast.collective("dp:0", 3, "all_reduce", entering=True, now_mono=10.5, now_wall=1e9 + 0.5)
    slow.collective("dp:0", 3, "all_reduce", entering=True, now_mono=10.5, now_wall=1e9 + 0.5)
    fast.step_ended(4, 1.5, 0.3, 0.2, 0.4, 11.5, 1e9 + 1.5, 128, 2.5)
    slow.step_done(4, 1.5, 0.3, 0.2, 0.4, 1e9 + 1.5, 128, 2.5)
    slow.progress(schema.RankState.COMPUTE, now_mono=11.5, now_wall=1e9 + 1.5)
    snaps = [progress.PageReader(w.path).snapshot() for w in (fast, slow)]
    assert snaps[0].state is schema.RankState.COMPUTE
    assert snaps[0].last == snaps[1].last and snaps[0].last.loss == 2.5
    fields = ("last_step", "step_start_mono_s", "progress_mono_s", "last_group", "last_seq")
    assert [getattr(snaps[0], f) for f in fields] == [getattr(snaps[1], f) for f in fields]
    assert [getattr(snaps[0], f) for f in fields] == [4, 10.0, 11.5, "dp:0", 3]
