"""The observing simulator (tests/support/observed.py): what its ranks record through the SDK.

These check the model's physics and that its records are the SDK's, not the analyzer's
assumptions: synchronous collectives end together, so the rank that arrives last has the
shortest duration; per-host clocks shift wall times but never durations; a hang stops every
rank that waits for the culprit, in the collective it waits in; heartbeats get lost.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tests.support import observed as ob
from vigil import codec, schema
from vigil.analyzer import arrays


def _records(job: ob.Job) -> list[schema.Record]:
    return [r for _t, batch in job.shipped for r in batch]


def _aggs(job: ob.Job) -> list[schema.CollectiveAggregate]:
    return [r for r in _records(job) if isinstance(r, schema.CollectiveAggregate)]


def test_same_seed_same_records_and_they_decode_as_wire_records() -> None:
    cfg = ob.JobConfig(dp=8, num_steps=6, seed=3)
    a, b = _records(ob.run(cfg)), _records(ob.run(cfg))
    assert [codec.encode_json(r) for r in a] == [codec.encode_json(r) for r in b]
    other = _records(ob.run(ob.JobConfig(dp=8, num_steps=6, seed=4)))
    assert [codec.encode_json(r) for r in a] != [codec.encode_json(r) for r in other]
    assert all(codec.decode_json(codec.encode_json(r)) == r for r in a[:50])


def test_the_late_rank_has_the_shortest_collective_and_the_others_wait_for_it() -> None:
    """A 2x straggler before forward on DDP: its bucket all-reduces (overlapped, op
    ddp_all_reduce) are the shortest; every other rank's last bucket is longer by ~its delay,
    which the SDK's own comm_wait_s cannot see (DDP waits inside C++)."""
    slow = ob.Fault(kind=ob.FaultKind.STRAGGLER, rank=5, start_step=2, factor=2.0)
    job = ob.run(ob.JobConfig(dp=8, num_steps=6, jitter=0.0, hiccup_rate=0.0, faults=(slow,)))
    last: dict[int, dict[int, float]] = defaultdict(dict)
    for a in _aggs(job):
        assert a.op == "ddp_all_reduce" and a.overlapped and a.group == "world"
        last[a.step][a.rank] = a.last_device_s
    for step in (3, 4, 5):
        durations = last[step]
        assert min(durations, key=durations.__getitem__) == 5
        others = [d for r, d in durations.items() if r != 5]
        assert min(others) - durations[5] > 0.5 * 0.6  # ~ the 0.6 s of compute it was late by
    steps = [r for r in _records(job) if isinstance(r, schema.StepRecord) and r.step == 4]
    assert all(s.comm_wait_s == 0.0 for s in steps)  # nothing blocked where the SDK looks
    a = arrays.from_records([*job.records, *_records(job)])
    assert int(np.argmin(a.wait_s[4])) == 5


def test_host_clock_offsets_move_wall_times_not_durations() -> None:
    job = ob.run(ob.JobConfig(dp=8, ranks_per_node=4, num_steps=3, clock_offset_s=0.5, seed=1))
    steps = {(r.rank, r.step): r for r in _records(job) if isinstance(r, schema.StepRecord)}
    offsets = job.wall_offset
    assert abs(offsets[0] - offsets[1]) > 0.01
    # Ranks of one node start step 0 at the same true instant: same wall time there...
    assert steps[(0, 0)].start_s == pytest.approx(steps[(3, 0)].start_s, abs=1e-6)
    # ...and across nodes apart by their hosts' offset.
    gap = steps[(4, 0)].start_s - steps[(0, 0)].start_s
    assert gap == pytest.approx(offsets[1] - offsets[0], abs=1e-6)
    # A collective ends together everywhere: the same end on every rank's own clock, modulo
    # the offsets, within the completion skew.
    ends = [s.end_s - offsets[job.cfg.node_of(s.rank)] for (_r, i), s in steps.items() if i == 1]
    assert max(ends) - min(ends) < 0.6 * 0.4  # the step's last phase differs by rank jitter


def test_tensor_parallel_groups_and_a_pipeline_s_pairs_each_count_their_own_sequence() -> None:
    job = ob.run(ob.JobConfig(tp=2, dp=2, pp=2, ddp=False, ranks_per_node=4, num_steps=3))
    by_group: dict[tuple[str, int, str], set[int]] = defaultdict(set)
    seqs: dict[tuple[str, int], set[int]] = defaultdict(set)
    for a in _aggs(job):
        by_group[(a.group, a.step, a.op)].add(a.rank)
        seqs[(a.group, a.step)].add(a.last_seq)
    groups = {g for g, _s, _o in by_group}
    assert {g.split(":")[0] for g in groups} == {"tp", "dp", "pp"}
    pair = next(g for g in groups if g.startswith("pp:") and g.endswith(":p2p:0-4"))
    # Activations go forward, gradients back: each member both sends and receives, 4 each way
    # (one per micro-batch), on the pair's one sequence counter.
    assert by_group[(pair, 1, "send")] == by_group[(pair, 1, "recv")] == {0, 4}
    pair_ops = [a for a in _aggs(job) if a.group == pair and a.step == 1]
    assert sorted(a.count for a in pair_ops) == [4, 4, 4, 4]
    assert max(a.last_seq for a in pair_ops) == 16  # 8 ops in step 0, 8 in step 1
    for (g, _step), last in seqs.items():  # every member agrees on each op's number
        if ":p2p:" not in g:
            assert len(last) == 1, g


def test_a_pipeline_s_stages_ship_their_schedule_and_forward_passes_without_their_p2p() -> None:
    """As the SDK times a pipeline: the schedule's time and the blocked time in it (the
    recorder's, read at both ends), forward hooks and backward passes that hold no send or
    receive. A stage slowed
    after its optimizer step makes the other stages wait inside their schedules."""
    slow = ob.Fault(kind=ob.FaultKind.STRAGGLER, rank=1, start_step=3, factor=2.0,
                    position=ob.Position.OPTIMIZER)  # fmt: skip
    cfg = ob.JobConfig(pp=2, dp=1, ddp=False, ranks_per_node=2, num_steps=6, jitter=0.0,
                       hiccup_rate=0.0, faults=(slow,))  # fmt: skip
    steps = {(r.rank, r.step): r for r in _records(ob.run(cfg)) if isinstance(r, schema.StepRecord)}
    for (_rank, step), s in steps.items():
        assert s.forward_s < s.pipeline_s < s.end_s - s.start_s
        assert 0.0 < s.pipeline_comm_wait_s < s.pipeline_s
        # The compute of its 2 layers x 4 micro-batches: a third of the stage's compute, which
        # varies by the rank's speed, the step's swing and each layer's wobble.
        assert s.forward_s == pytest.approx(cfg.compute_s / 3, rel=0.2), step
        # Its backward passes (0.6 of its compute), without the receives between them.
        assert s.stage_backward_s == pytest.approx(0.6 * cfg.compute_s, rel=0.2), step
        assert s.stage_backward_wait_s == 0.0  # no tensor-parallel all-reduce in there
        assert s.comm_wait_s == pytest.approx(s.pipeline_comm_wait_s, abs=1e-9)  # no dp group
    before, after = steps[(0, 2)], steps[(0, 4)]
    # Stage 0 waits for the slowed stage 1 (0.6 s more compute) in its schedule's receives.
    assert after.pipeline_comm_wait_s - before.pipeline_comm_wait_s > 0.5 * cfg.compute_s
    assert after.forward_s == pytest.approx(before.forward_s, rel=0.2)
    # Without a pipeline nothing is inside a schedule.
    flat = _records(ob.run(ob.JobConfig(tp=2, dp=2, ddp=False, ranks_per_node=4, num_steps=2)))
    flat_steps = [r for r in flat if isinstance(r, schema.StepRecord)]
    assert all(r.pipeline_s == r.stage_backward_s == 0.0 for r in flat_steps)


def test_a_hang_stops_everyone_who_waits_for_the_culprit_in_that_collective() -> None:
    hang = ob.Fault(kind=ob.FaultKind.HANG, rank=6, start_step=4, position=ob.Position.BACKWARD)
    job = ob.run(ob.JobConfig(tp=2, dp=4, ddp=False, num_steps=10, heartbeat_loss=0.0,
                              faults=(hang,)))  # fmt: skip
    assert job.hang is not None and job.hang.rank == 6 and job.hang.step == 4
    later = job.hang.onset_s + 30.0
    beats = {r: job.heartbeat(r, later) for r in range(job.cfg.num_ranks)}
    assert all(b.last_step == 3 for b in beats.values())
    culprit = beats.pop(6)
    assert culprit.state == schema.RankState.COMPUTE
    assert all(b.state == schema.RankState.IN_COLLECTIVE for b in beats.values())
    partner = beats[7]  # its tp peer waits in the tp all-reduce rank 6 never entered
    assert partner.last_group == culprit.last_group and partner.last_seq == culprit.last_seq + 1


def test_heartbeats_are_lost_at_the_configured_rate() -> None:
    job = ob.run(ob.JobConfig(dp=16, num_steps=20, heartbeat_loss=0.25, seed=2))
    start = job.ranks[0].page.data_spans[0][0]
    sent = list(job.heartbeats(start, job.end_s()))
    expected = 16 * (job.end_s() - start) / job.cfg.heartbeat_interval_s
    assert 0.6 * expected < len(sent) < 0.9 * expected
    assert [t for t, _b in sent] == sorted(t for t, _b in sent)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ob.JobConfig(tp=2, ddp=True), "ddp buckets need tp = pp = 1"),
        (lambda: ob.JobConfig(dp=0), "must be >= 1"),
        (
            lambda: ob.JobConfig(
                dp=4, faults=(ob.Fault(kind=ob.FaultKind.STRAGGLER, rank=4, start_step=1),)
            ),
            "outside 0..3",
        ),
        (lambda: ob.Fault(kind=ob.FaultKind.STRAGGLER, rank=0, start_step=1, factor=0.5), ">= 1"),
    ],
)
def test_bad_configuration_says_what_to_change(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
