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


def _later(index: int, *, seq: int, mono: float, end: float = 0.0) -> progress.LaterEvent:
    group, op, dtype = (progress.encode_group("world"), progress.encode_op("ddp_all_reduce"),
                        progress.encode_dtype("float32"))  # fmt: skip
    return progress.LaterEvent(index, seq, 2, 4096, 1e9 + mono, mono, end, group, op, dtype)


def test_an_op_published_after_its_launch_is_the_pages_newest_position(tmp_path: Path) -> None:
    """A DDP bucket reaches the page from the flusher: once there, its slot reads like any other
    and, being the newest op, it is the rank's position, unless the rank is inside an op."""
    writer = _writer(tmp_path)
    reader = progress.PageReader(writer.path)
    writer.step_begun(2, 10.0, 1e9 + 10.0)
    _event(writer, 0)  # the step's own sync op, index 0, then two buckets launched
    writer.collective("tp:2", 1, "all_reduce", entering=False, now_mono=10.2, now_wall=1e9 + 10.2)
    before = reader.snapshot()
    writer.publish_events(
        [_later(1, seq=7, mono=10.5, end=1e9 + 10.6), _later(2, seq=8, mono=10.7)]
    )
    snap = reader.snapshot()
    assert (before.ring_head, before.last_group, before.last_seq) == (1, "tp:2", 1)
    assert (snap.ring_head, snap.last_group, snap.last_seq, snap.last_op) == (
        3, "world", 8, "ddp_all_reduce",
    )  # fmt: skip
    assert snap.progress_mono_s == 10.7 and snap.state is schema.RankState.COMPUTE
    events = reader.events()
    assert [(e.seq, e.op) for e in events] == [(1, "all_reduce"), (7, "ddp_all_reduce"),
                                               (8, "ddp_all_reduce")]  # fmt: skip
    assert events[1].end_s == 1e9 + 10.6 and events[2].end_s == 0.0  # the second still runs
    writer.finish_event(2, 1e9 + 10.9)
    assert reader.events()[2].end_s == 1e9 + 10.9
    # A newer op of the training thread's own takes the position back ...
    _event(writer, 3)
    writer.collective("tp:2", 4, "all_reduce", entering=True, now_mono=11.0, now_wall=1e9 + 11)
    inside = reader.snapshot()
    assert (inside.ring_head, inside.last_seq, inside.state) == (
        4, 4, schema.RankState.IN_COLLECTIVE,
    )  # fmt: skip
    # ... and inside an op the rank's position stays that op, whatever is published later.
    writer.publish_events([_later(4, seq=9, mono=11.1)])
    still = reader.snapshot()
    assert (still.ring_head, still.last_group, still.last_seq) == (5, "tp:2", 4)
    assert [e.seq for e in reader.events()] == [1, 7, 8, 4, 9]
    reader.close()
    writer.close()


def test_an_op_published_after_the_ring_lapped_its_slot_is_dropped(tmp_path: Path) -> None:
    writer = _writer(tmp_path, capacity=4)
    for index in range(1, 9):  # index 0 is launched first but published only now
        _event(writer, index)
    writer.collective("tp:2", 9, "all_reduce", entering=False, now_mono=1.0, now_wall=1e9)
    writer.publish_events([_later(0, seq=1, mono=0.5)])
    reader = progress.PageReader(writer.path)
    assert [e.seq for e in reader.events()] == [6, 7, 8, 9]  # index 4's slot is index 8's
    assert reader.snapshot().ring_head == 9
    reader.close()
    writer.close()


def test_the_recorder_puts_ddp_buckets_on_the_page_when_published(tmp_path: Path) -> None:
    """Overlapped ops (DDP's buckets) cost the training thread no page write: `publish` (the
    flusher) writes them, with the end of each that has ended, ended before or while."""
    from vigil.agent import collectives

    writer = _writer(tmp_path)
    reader = progress.PageReader(writer.path)
    errors: list[BaseException] = []
    recorder = collectives.CollectiveRecorder(page=writer, on_error=errors.append)
    recorder.step = 2
    bucket = torch.ones(8)
    first = recorder.begin("ddp_all_reduce", None, bucket, None, blocking=False, overlapped=True)
    second = recorder.begin("ddp_all_reduce", None, bucket, None, blocking=False, overlapped=True)
    recorder.finish(first, sync=False)  # on the comm thread, before the flusher comes
    assert reader.snapshot().ring_head == 0 and reader.events() == []
    recorder.publish()
    events = reader.events()
    assert [(e.seq, e.op, e.bytes, e.dtype, e.step) for e in events] == [
        (1, "ddp_all_reduce", 32, "float32", 2), (2, "ddp_all_reduce", 32, "float32", 2),
    ]  # fmt: skip
    assert events[0].end_s >= events[0].start_s > 0 and events[1].end_s == 0.0
    recorder.finish(second, sync=False)
    assert reader.events()[1].end_s >= events[1].start_s
    snap = reader.snapshot()
    assert (snap.ring_head, snap.last_group, snap.last_seq) == (2, "world", 2)
    recorder.publish()  # nothing new: nothing changes
    assert reader.snapshot().ring_head == 2 and len(reader.events()) == 2
    assert errors == []
    reader.close()
    writer.close()


def test_the_live_flags_say_between_steps_and_compiling(tmp_path: Path) -> None:
    """Between steps: set when a step ends, cleared when the next begins; compiling: set and
    cleared by torch's compile callbacks, keeping the other flag, and cleared by a step's end
    (a compile never outlives the step that ran it)."""
    writer = _writer(tmp_path)
    reader = progress.PageReader(writer.path)

    def flags() -> tuple[bool, bool]:
        snap = reader.snapshot()
        return snap.between_steps, snap.compiling

    assert flags() == (False, False)
    writer.step_begun(0, 1.0, 1e9)
    writer.compiling(True)
    assert flags() == (False, True)
    writer.compiling(False)
    writer.step_ended(0, 0.5, 0.0, 0.0, 0.0, 1.5, 1e9 + 0.5, 8, 1.0)
    assert flags() == (True, False)
    writer.compiling(True)  # e.g. the evaluation's model, between steps
    assert flags() == (True, True)
    writer.step_begun(1, 2.0, 1e9 + 1)
    assert flags() == (False, True)
    writer.step_ended(1, 0.5, 0.0, 0.0, 0.0, 2.5, 1e9 + 1.5, 8, 1.0)
    assert flags() == (True, False)  # its end callback missed: the step's end clears it
