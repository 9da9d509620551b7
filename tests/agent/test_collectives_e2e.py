"""One 4-rank gloo launch (DDP, FSDP2, two kinds of tensor parallel, async + p2p, a peer entering
an all-reduce a known time late), checked.

The job runs `dist_scenarios.py` in real processes; assertions read what a user would read: the
JSONL step records and collective aggregates, and the raw events in each rank's ring buffer.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.agent import conftest
from vigil import codec, schema
from vigil.agent import progress

pytestmark = pytest.mark.e2e
WORLD = 4
JOB = "scenarios"
HIDDEN = 32
PARAM_BYTES = (HIDDEN * HIDDEN + HIDDEN) * 2 * 4  # two fp32 Linear layers
LATE_RANK, LATE_S = 3, 0.2  # as dist_scenarios.py injects them at step 50


class Run:
    def __init__(self, out: Path, pages: Path) -> None:
        self.records: dict[int, list[schema.Record]] = {}
        self.events: dict[int, list[schema.CollectiveEvent]] = {}
        for rank in range(WORLD):
            path = out / JOB / f"rank-{rank:05d}.jsonl"
            self.records[rank] = [
                codec.decode_json(line) for line in path.read_bytes().splitlines()
            ]
            reader = progress.PageReader(out / "kept-pages" / f"rank-{rank:05d}.page")
            self.events[rank] = reader.events()
            reader.close()

    def aggs(self, rank: int, steps: range) -> list[schema.CollectiveAggregate]:
        return [
            r
            for r in self.records[rank]
            if isinstance(r, schema.CollectiveAggregate) and r.step in steps
        ]

    def steps(self, rank: int) -> list[schema.StepRecord]:
        return [r for r in self.records[rank] if isinstance(r, schema.StepRecord)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("scenarios")
    out, pages = base / "out", base / "pages"
    procs = conftest.launch("dist_scenarios.py", WORLD, [str(out), str(pages)], log_dir=base)
    conftest.wait_all(procs, timeout_s=150, log_dir=base)
    # Every rank ended cleanly: the last one out removed the run's progress folder.
    assert pages.is_dir() and list(pages.iterdir()) == []
    return Run(out, pages)


def test_ddp_gradient_allreduce_is_timed_through_the_comm_hook(run: Run) -> None:
    for rank in range(WORLD):
        aggs = run.aggs(rank, range(0, 3))
        # DDP's buckets are their own op, overlapped: DDP waits for them inside C++.
        assert [(a.step, a.group, a.op, a.overlapped) for a in aggs] == [
            (0, "world", "ddp_all_reduce", True),
            (1, "world", "ddp_all_reduce", True),
            (2, "world", "ddp_all_reduce", True),
        ]
        assert all(a.bytes == PARAM_BYTES and a.count == 1 for a in aggs)
        assert [a.last_seq for a in aggs] == [1, 2, 3]
        assert all(a.total_device_s > 0 for a in aggs)
        assert all(a.last_device_s == a.total_device_s for a in aggs)  # one bucket each


def test_fsdp2_all_gathers_and_reduce_scatters_are_recorded(run: Run) -> None:
    for rank in range(WORLD):
        by_op = collections.defaultdict(list)
        for a in run.aggs(rank, range(10, 13)):
            by_op[a.op].append(a)
        assert set(by_op) == {"all_gather_single", "reduce_scatter_single"}
        # Per step: forward and backward each all-gather both layers; backward reduce-scatters
        # their gradients. Each all-gather output is one whole layer.
        assert [a.count for a in by_op["all_gather_single"]] == [4, 4, 4]
        assert [a.bytes for a in by_op["all_gather_single"]] == [2 * PARAM_BYTES] * 3
        assert [a.count for a in by_op["reduce_scatter_single"]] == [2, 2, 2]
        assert [a.bytes for a in by_op["reduce_scatter_single"]] == [PARAM_BYTES] * 3


def test_tensor_parallel_allreduces_carry_their_group(run: Run) -> None:
    groups = {}
    for rank in range(WORLD):
        aggs = run.aggs(rank, range(20, 23))
        assert {a.op for a in aggs} == {"all_reduce"}
        assert [a.bytes for a in aggs] == [8 * HIDDEN * 4] * 3  # batch x hidden fp32 activations
        assert [a.last_seq for a in aggs] == [1, 2, 3]
        (group,) = {a.group for a in aggs}
        assert group.startswith("tp:")
        groups[rank] = group
    # Ranks 0,1 form one TP group and 2,3 the other: same name inside a group, different across.
    assert groups[0] == groups[1] != groups[2] == groups[3]


def test_dtensor_tensor_parallel_functional_collectives_are_recorded(run: Run) -> None:
    groups = {}
    for rank in range(WORLD):
        aggs = run.aggs(rank, range(40, 43))
        # RowwiseParallel's output: Partial -> Replicate, one functional all-reduce per step.
        assert [(a.step, a.op, a.count) for a in aggs] == [
            (40, "all_reduce", 1),
            (41, "all_reduce", 1),
            (42, "all_reduce", 1),
        ]
        assert [a.bytes for a in aggs] == [8 * HIDDEN * 4] * 3
        assert [a.last_seq for a in aggs] == [1, 2, 3]
        (groups[rank],) = {a.group for a in aggs}
    assert groups[0] == groups[1] != groups[2] == groups[3]
    assert groups[0].startswith("tp:")  # the DeviceMesh dimension's name


def test_async_and_point_to_point_ops_complete_with_peer_groups(run: Run) -> None:
    for rank in range(WORLD):
        aggs = {(a.group, a.op): a for a in run.aggs(rank, range(30, 31))}
        right, left = (rank + 1) % WORLD, (rank - 1) % WORLD
        send_group = f"world:p2p:{min(rank, right)}-{max(rank, right)}"
        recv_group = f"world:p2p:{min(rank, left)}-{max(rank, left)}"
        assert set(aggs) == {("world", "all_reduce"), (send_group, "isend"), (recv_group, "recv")}
        assert aggs[("world", "all_reduce")].bytes == 256 * 4
        assert aggs[(send_group, "isend")].bytes == aggs[(recv_group, "recv")].bytes == 64 * 4


def test_sequence_numbers_agree_across_ranks(run: Run) -> None:
    def world_ops(rank: int) -> list[tuple[int, str, int]]:
        return [(e.seq, e.op, e.bytes) for e in run.events[rank] if e.group == "world"]

    reference = world_ops(0)
    assert len(reference) == 3 + 3 * 6 + 1 + 1  # DDP, FSDP2, async, the late all-reduce
    assert [seq for seq, _, _ in reference] == list(range(1, len(reference) + 1))
    assert all(world_ops(rank) == reference for rank in range(1, WORLD))


def test_aggregates_add_up_to_the_raw_events(run: Run) -> None:
    for rank in range(WORLD):
        events = run.events[rank]
        assert events and all(e.end_s >= e.start_s > 0 for e in events)
        raw: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        for e in events:
            totals = raw[(e.group, e.op)]
            totals[0] += 1
            totals[1] += e.bytes
            totals[2] = max(totals[2], e.seq)
        summed: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        for a in run.aggs(rank, range(0, 10_000)):
            totals = summed[(a.group, a.op)]
            totals[0] += a.count
            totals[1] += a.bytes
            totals[2] = max(totals[2], a.last_seq)
        assert summed == raw


def test_step_records_have_phases_and_mfu(run: Run) -> None:
    for rank in range(WORLD):
        steps = run.steps(rank)
        assert [s.step for s in steps] == [0, 1, 2, 10, 11, 12, 20, 21, 22, 40, 41, 42, 30, 50]
        trained = [s for s in steps if s.step not in (30, 50)]
        assert all(s.forward_s > 0 and s.backward_s > 0 and s.optimizer_s > 0 for s in trained)
        assert all(s.loss is not None and s.loss > 0 for s in trained)
        assert all(0 < s.mfu < 1 and s.tokens == 8 for s in trained)
        assert all(s.end_s - s.start_s >= s.forward_s + s.backward_s for s in trained)
        # The p2p step blocks in recv and wait(): that is exposed communication time.
        p2p = next(s for s in steps if s.step == 30)
        assert p2p.comm_wait_s > 0


def test_a_peer_entering_late_shows_as_the_others_wait(run: Run) -> None:
    """Released together, rank 3 enters a world all-reduce 0.2 s after the others: their
    all-reduce lasts about 0.2 s, all of it exposed wait; the late rank's is short."""
    for rank in range(WORLD):
        ((agg,),) = [run.aggs(rank, range(50, 51))]
        assert (agg.group, agg.op, agg.count, agg.bytes) == ("world", "all_reduce", 1, 16 * 4)
        event = next(e for e in run.events[rank] if e.group == "world" and e.seq == agg.last_seq)
        (step,) = [s for s in run.steps(rank) if s.step == 50]
        timings = {
            "aggregate": agg.total_device_s,
            "event": event.end_s - event.start_s,
            "comm_wait": step.comm_wait_s,
        }
        if rank == LATE_RANK:
            assert all(t < LATE_S / 4 for t in timings.values()), timings
            assert step.end_s - step.start_s >= LATE_S  # it slept in its step
        else:
            assert all(LATE_S - 0.05 <= t <= LATE_S + 0.15 for t in timings.values()), timings
