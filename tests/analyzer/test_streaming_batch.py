"""The streaming analyzer's batch fast paths give what the record-by-record rules give.

`aggcols.attribute_row` against `attribution.attribute`, `positions.Positions` against a dict of
dicts updated one record at a time, `HangTracker.observe_heartbeats` against
`observe_heartbeat` per record, and `aggcols.split` against filtering by type.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from vigil import schema
from vigil.analyzer import aggcols, attribution, hangs, positions, streaming
from vigil.analyzer import config as config_mod


def _aggs(rng: random.Random, *, ranks: int, disagree: bool) -> list[schema.CollectiveAggregate]:
    out = []
    for rank in range(ranks):
        for group, op, overlapped in (
            ("dp", "all_reduce", True),
            (f"tp:{rank // 4}", "all_gather", False),
            (f"pp:{rank % 2}", "send" if rank % 4 < 2 else "recv", False),
        ):
            count = rng.choice([1, 3]) if disagree else 3
            out.append(
                schema.CollectiveAggregate(
                    job_id="j",
                    rank=rank,
                    step=7,
                    group=group,
                    op=op,
                    count=count,
                    bytes=4096 * count,
                    total_device_s=rng.uniform(0.01, 0.2),
                    last_seq=100 + (rng.randrange(2) if disagree else 0),
                    last_device_s=rng.choice([0.0, rng.uniform(0.001, 0.05)]),
                    overlapped=overlapped,
                )
            )
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("disagree", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_row_attribution_equals_attribution(seed: int, disagree: bool) -> None:
    rng = random.Random(seed)
    records = _aggs(rng, ranks=13, disagree=disagree)
    names = aggcols.Names({})
    batch = aggcols.agg_batch(records, names)
    width = 16
    cols = batch.columns(np.zeros(len(batch), dtype=np.int64), batch.rank)
    keys: dict[tuple[str, str], int] = {}
    reference = attribution.attribute(
        attribution.columns_of(records, {7: 0}, {r: r for r in range(13)}, keys), (1, width)
    )
    assert keys == names.keys  # the same (group, op class) ids, in the same order
    fast = aggcols.attribute_row(cols, width)
    for name in ("wait_s", "hidden_wait_s", "transfer_s"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(reference, name))
    assert np.isfinite(fast.wait_s).sum() >= 8  # attributed, not all NaN


def test_row_attribution_of_lone_members_is_nan() -> None:
    records = [
        schema.CollectiveAggregate(
            job_id="j",
            rank=r,
            step=1,
            group=f"g{r}",
            op="all_reduce",
            count=1,
            total_device_s=0.1,
        )
        for r in range(3)
    ]
    batch = aggcols.agg_batch(records, aggcols.Names({}))
    fast = aggcols.attribute_row(batch.columns(np.zeros(3, dtype=np.int64), batch.rank), 3)
    assert np.isnan(fast.wait_s).all()


def _reference_raise(seqs: dict[str, dict[int, int]], group: str, rank: int, seq: int) -> None:
    members = seqs.setdefault(group, {})
    if seq >= members.get(rank, -1):
        members[rank] = seq


def test_positions_follow_record_by_record_updates() -> None:
    rng = random.Random(5)
    names = aggcols.Names({})
    fast = positions.Positions(names)
    reference: dict[str, dict[int, int]] = {}
    groups = [f"g{i}" for i in range(6)]
    for _ in range(300):
        what = rng.randrange(4)
        if what == 0:
            g, r, s = rng.choice(groups), rng.randrange(20), rng.randrange(50)
            fast.raise_one(g, r, s)
            _reference_raise(reference, g, r, s)
        elif what == 1:
            g, r, s = rng.choice(groups), rng.randrange(20), rng.randrange(50)
            fast.set_one(g, r, s)
            reference.setdefault(g, {})[r] = s
        elif what == 2:  # a batch of aggregates, repeats included
            picks = [(rng.choice(groups), rng.randrange(20), rng.randrange(50)) for _ in range(30)]
            for g, r, s in picks:
                _reference_raise(reference, g, r, s)
            fast.raise_to(
                np.array([names.group_id(g) for g, _, _ in picks], dtype=np.int64),
                np.array([r for _, r, _ in picks], dtype=np.int64),
                np.array([s for _, _, s in picks], dtype=np.int64),
            )
        else:  # heartbeats: one per rank
            ranks = rng.sample(range(20), 8)
            picks = [(rng.choice(groups), r, rng.randrange(50)) for r in ranks]
            for g, r, s in picks:
                reference.setdefault(g, {})[r] = s
            fast.set_to(
                np.array([names.group_id(g) for g, _, _ in picks], dtype=np.int64),
                np.array(ranks, dtype=np.int64),
                np.array([s for _, _, s in picks], dtype=np.int64),
            )
        if rng.random() < 0.1:
            seen = fast.seqs()
            assert seen == reference
            assert list(seen) == list(reference)  # groups in the same order
            assert all(list(seen[g]) == list(reference[g]) for g in seen)  # and members


def _beats(rng: random.Random, n: int, t0: float) -> list[schema.Heartbeat]:
    states = list(schema.RankState)
    out = []
    for rank in rng.sample(range(40), n):
        state = rng.choice(states)
        out.append(
            schema.Heartbeat(
                job_id="j",
                rank=rank,
                time_s=t0 + rng.uniform(-2.0, 1.0),
                last_step=3,
                last_group=rng.choice(["", "dp", f"tp:{rank // 4}"]),
                last_seq=rng.randrange(30),
                last_op=rng.choice(["", "all_reduce"]),
                state=state,
                checkpoints=rng.randrange(3),
            )
        )
    return out


def _state(t: hangs.HangTracker) -> tuple[object, ...]:
    return (
        t._life.last_beat,
        list(t._life.last_beat),
        t._life.failed,
        list(t._life.failed),
        {r: c for r, c in t._checkpoints.items() if c},
        t._positions.seqs(),
        [list(m) for m in t._positions.seqs().values()],
        t._wait_list(),
        t._finished,
        t._checkpointing,
        t._ranks,
        t._entered,
    )


def test_heartbeat_batches_equal_one_by_one() -> None:
    rng = random.Random(9)
    cfg = config_mod.HangConfig()
    one, bulk = hangs.HangTracker("j", cfg), hangs.HangTracker("j", cfg)
    for i in range(40):
        beats = _beats(rng, rng.randrange(1, 30), 100.0 + i)
        if i % 7 == 3:
            beats.append(beats[0])  # a rank twice in a batch: taken one by one
        if i == 20:
            for t in (one, bulk):
                t.restarting(119.5)
        for hb in beats:
            one.observe_heartbeat(hb)
        bulk.observe_heartbeats(beats)
        assert _state(bulk) == _state(one)
        assert bulk.check(101.0 + i) == one.check(101.0 + i)


def test_heartbeat_batches_with_ranks_beating_several_times_equal_one_by_one() -> None:
    """Merged shipments carry several heartbeats of a rank: each rank's are taken in order,
    and the tracker ends where one-by-one updates leave it (up to which rank came first)."""
    rng = random.Random(11)
    cfg = config_mod.HangConfig()
    one, bulk = hangs.HangTracker("j", cfg), hangs.HangTracker("j", cfg)
    for i in range(40):
        beats = [hb for k in range(rng.randrange(2, 5)) for hb in _beats(rng, 12, 100.0 + i + k)]
        rng.shuffle(beats)
        assert aggcols.repeats(np.array([hb.rank for hb in beats]))
        for hb in beats:
            one.observe_heartbeat(hb)
        bulk.observe_heartbeats(beats)
        assert _unordered(bulk) == _unordered(one)
        assert bulk.check(101.0 + i) == one.check(101.0 + i)


def _unordered(t: hangs.HangTracker) -> tuple[object, ...]:
    """`_state` without the order in which different ranks were first seen (which of two
    ranks' heartbeats came first in a batch is arbitrary; nothing reads that order)."""
    return (
        t._life.last_beat,
        t._life.failed,
        {r: c for r, c in t._checkpoints.items() if c},
        t._positions.seqs(),
        sorted(t._wait_list(), key=lambda w: w.rank),
        t._finished,
        t._checkpointing,
        t._ranks,
        t._entered,
    )


def test_occurrence_counts_earlier_equal_values() -> None:
    values = np.array([5, 3, 5, 5, 0, 3], dtype=np.int64)
    assert aggcols.occurrence(values).tolist() == [0, 0, 1, 2, 0, 1]
    assert aggcols.occurrence(np.zeros(0, dtype=np.int64)).tolist() == []


def test_split_keeps_each_type_in_order() -> None:
    records: list[schema.Record] = []
    for r in range(5):
        records.append(schema.StepRecord(job_id="j", rank=r, step=1, start_s=0.0, end_s=1.0))
        records.append(
            schema.CollectiveAggregate(job_id="j", rank=r, step=1, group="dp", op="x", count=1)
        )
        records.append(schema.Heartbeat(job_id="j", rank=r, time_s=1.0))
        records.append(schema.RankInfo(job_id="j", rank=r, world_size=5, node="n"))
    records.append(
        schema.Finding(
            finding_id="f",
            job_id="j",
            kind=schema.FindingKind.HANG,
            summary="s",
        )
    )
    steps, aggs, beats, others = aggcols.split(records)
    assert steps == [r for r in records if type(r) is schema.StepRecord]
    assert aggs == [r for r in records if type(r) is schema.CollectiveAggregate]
    assert beats == [r for r in records if type(r) is schema.Heartbeat]
    assert others == [r for r in records if type(r) is schema.RankInfo]
    read = streaming._READ - {schema.StepRecord, schema.CollectiveAggregate, schema.Heartbeat}
    assert read == aggcols.OTHERS


def _transfer_fields(g: attribution.GroupTransfer) -> list[list[object]]:
    members = g.members(list(range(g.row.size)))
    return [g.row.tolist(), g.key.tolist(), g.transfer_s.tolist(), g.nbytes.tolist(), members]


def test_window_transfers_kept_per_row_equal_group_transfer_of_its_aggregates() -> None:
    # The slow-link check reads each row's group transfers, computed once and kept: they must
    # be what `group_transfer` gives for the view's aggregates, also after a row receives more
    # aggregates (a late rank's batch) and after the ring reuses a row for a newer step.
    from vigil.analyzer import window as window_mod

    rng = random.Random(9)
    w = window_mod.StepWindow("j", 4, 13)

    def batch(step: int, ranks: range) -> list[schema.CollectiveAggregate]:
        records = [r for r in _aggs(rng, ranks=13, disagree=step % 2 == 1) if r.rank in ranks]
        for r in records:
            r.step = step
        return records

    def check(steps: list[int]) -> None:
        kept = w.view(steps, with_transfers=True).transfers
        assert kept is not None
        aggs = w.view(steps, with_aggs=True).aggs
        assert aggs is not None
        assert _transfer_fields(kept) == _transfer_fields(attribution.group_transfer(aggs))
        assert kept.row.size >= len(steps)  # something comparable in every row

    w.add_aggregates(batch(0, range(13)), 0)
    for step in (1, 2):
        w.add_aggregates(batch(step, range(7)), 0)
    check([0, 1, 2])
    for step in (1, 2):
        w.add_aggregates(batch(step, range(7, 13)), 0)  # the rest of each step's ranks
    check([0, 1, 2])
    w.add_aggregates(batch(4, range(13)), 0)  # row 0 now holds step 4
    check([1, 2, 4])
    w.row_for(5)  # row 1 now holds step 5, of which nothing arrived yet
    assert (kept := w.view([5], with_transfers=True).transfers) is not None
    assert kept.row.size == 0
