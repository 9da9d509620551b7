"""Cross-rank wait attribution and crash findings, on hand-built records with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from vigil import schema
from vigil.analyzer import attribution, config, hangs


def _agg(rank: int, total: float, last: float, *, step: int = 0, overlapped: bool = False,
         group: str = "world", op: str = "all_reduce", count: int = 4, seq: int = 4,
         ) -> schema.CollectiveAggregate:  # fmt: skip
    return schema.CollectiveAggregate(
        job_id="j", rank=rank, step=step, group=group, op=op, count=count,
        total_device_s=total, last_device_s=last, last_seq=seq, overlapped=overlapped,
    )  # fmt: skip


def _attribute(aggs: list[schema.CollectiveAggregate], ranks: int = 3) -> attribution.Attribution:
    steps = sorted({a.step for a in aggs})
    cols = attribution.columns_of(
        aggs, {s: i for i, s in enumerate(steps)}, {r: r for r in range(ranks)}, {}
    )
    return attribution.attribute(cols, (len(steps), ranks))


def test_synchronous_waits_add_and_the_last_arrival_waits_nothing() -> None:
    # Rank 2 arrives last at every op: the others' durations are longer by their waits.
    got = _attribute([_agg(0, 0.50, 0.1), _agg(1, 0.40, 0.1), _agg(2, 0.10, 0.025)])
    np.testing.assert_allclose(got.wait_s[0], [0.40, 0.30, 0.0], atol=1e-6)
    np.testing.assert_allclose(got.hidden_wait_s[0], [0.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(got.transfer_s[0], [0.10, 0.10, 0.10], atol=1e-6)


def test_transfer_is_not_inflated_when_the_last_arrival_changes_between_ops() -> None:
    # Two 0.01 s all-gathers: rank 0 arrives last at the first (ranks 1, 2 wait 0.05, 0.03),
    # rank 1 at the second (ranks 0, 2 wait 0.04, 0.02). No member's total is waits-free (the
    # shortest, rank 0's 0.06 s, holds its 0.04 s wait at the second op); the last op alone
    # shows its transfer (rank 1's 0.01 s).
    got = _attribute(
        [
            _agg(0, 0.01 + 0.05, 0.05, count=2, seq=2),
            _agg(1, 0.06 + 0.01, 0.01, count=2, seq=2),
            _agg(2, 0.04 + 0.03, 0.03, count=2, seq=2),
        ]
    )
    np.testing.assert_allclose(got.transfer_s[0], [0.02, 0.02, 0.02], atol=1e-6)
    np.testing.assert_allclose(got.wait_s[0], [0.04, 0.05, 0.05], atol=1e-6)


def test_overlapped_ops_wait_once_for_the_last() -> None:
    # DDP's buckets: every bucket of ranks 0 and 1 waited for rank 2, but the training thread
    # blocks only for the last one; summing the buckets would count the wait four times.
    got = _attribute(
        [
            _agg(0, 0.44, 0.12, overlapped=True),
            _agg(1, 0.44, 0.12, overlapped=True),
            _agg(2, 0.04, 0.02, overlapped=True),
        ]
    )
    np.testing.assert_allclose(got.wait_s[0], [0.10, 0.10, 0.0], atol=1e-6)
    np.testing.assert_allclose(got.hidden_wait_s[0], [0.10, 0.10, 0.0], atol=1e-6)
    np.testing.assert_allclose(got.transfer_s[0], [0.04, 0.04, 0.04], atol=1e-6)


def test_members_that_saw_other_ops_are_not_compared() -> None:
    # Rank 1's aggregate ended at another sequence number (its step boundary fell elsewhere):
    # it is left out; a group with a single comparable member attributes nothing.
    got = _attribute([_agg(0, 0.5, 0.1), _agg(1, 0.1, 0.1, seq=5), _agg(2, 0.2, 0.1)])
    np.testing.assert_allclose(got.wait_s[0], [0.3, np.nan, 0.0], atol=1e-6)
    alone = _attribute([_agg(0, 0.5, 0.1)])
    assert np.isnan(alone.wait_s).all() and np.isnan(alone.transfer_s).all()


def test_sends_and_receives_of_a_pair_are_matched() -> None:
    # Pipeline p2p: the receiver (rank 1) waited for the sender (rank 0).
    aggs = [
        _agg(0, 0.01, 0.01, group="world:p2p:0-1", op="isend", count=1, seq=1),
        _agg(1, 0.21, 0.21, group="world:p2p:0-1", op="irecv", count=1, seq=1),
    ]
    got = _attribute(aggs, ranks=2)
    np.testing.assert_allclose(got.wait_s[0], [0.0, 0.2], atol=1e-6)
    assert attribution.op_class("isend") == attribution.op_class("recv") == "p2p"


def _beat(rank: int, t: float, state: schema.RankState) -> schema.Heartbeat:
    return schema.Heartbeat(job_id="j", rank=rank, time_s=t, last_step=3, state=state)


@pytest.fixture
def tracker() -> hangs.HangTracker:
    t = hangs.HangTracker("j", config.HangConfig())
    for step in range(5):
        t.observe_step_time(step, 100.0 + step, 1.0)
    for rank in range(4):
        t.observe_seq(rank, "world", 5, "all_reduce")
    return t


def test_a_rank_killed_outright_is_the_crash_culprit(tracker: hangs.HangTracker) -> None:
    for rank in range(4):
        tracker.observe_heartbeat(_beat(rank, 104.5, schema.RankState.COMPUTE))
    for rank in (0, 1, 2):  # their collectives broke when rank 3 vanished
        tracker.observe_heartbeat(_beat(rank, 105.2, schema.RankState.FAILED))
    assert tracker.check(105.5) is None  # the peers' last words may still be arriving
    crash = tracker.check(108.5)
    assert crash is not None and crash.kind == "crash" and crash.subjects.ranks == [3]
    assert tracker.check(200.0) is None  # a crashed job is not also reported hung


def test_the_first_rank_to_fail_is_the_culprit_when_all_said_failed(
    tracker: hangs.HangTracker,
) -> None:
    tracker.observe_heartbeat(_beat(2, 105.0, schema.RankState.FAILED))
    for rank in (0, 1, 3):
        tracker.observe_heartbeat(_beat(rank, 105.3, schema.RankState.FAILED))
    crash = tracker.check(105.3, final=True)
    assert crash is not None and crash.subjects.ranks == [2]


def test_a_silent_rank_among_beating_peers_is_a_crash_not_a_hang(
    tracker: hangs.HangTracker,
) -> None:
    tracker.observe_heartbeat(_beat(1, 104.0, schema.RankState.COMPUTE))
    for rank in (0, 2, 3):  # alive, waiting for rank 1
        tracker.observe_heartbeat(_beat(rank, 109.5, schema.RankState.IN_COLLECTIVE))
    crash = tracker.check(110.0)
    assert crash is not None and crash.kind == "crash" and crash.subjects.ranks == [1]


def test_where_heartbeats_went_missing_a_rank_must_be_silent_longer_to_be_crashed(
    tracker: hangs.HangTracker,
) -> None:
    """Rank 2's beats of seconds 101-103 never came (a 4 s gap it lived through): a silence
    is a crash only once it is twice that long, 8 s, not at the usual 5 s."""
    assert tracker.crash_silence_s() == 5.0
    for second in range(19):
        for rank in range(4):
            lost = (rank == 2 and 1 <= second <= 3) or (rank == 1 and second > 10)
            if not lost:
                tracker.observe_heartbeat(_beat(rank, 100.5 + second, schema.RankState.COMPUTE))
        if second < 18:  # rank 1 beat last at 110.5: silent for less than 8 s
            finding = tracker.check(100.6 + second)
            assert finding is None or finding.kind == "hang"
    assert tracker.crash_silence_s() == 8.0
    crash = tracker.check(118.6)
    assert crash is not None and crash.kind == "crash" and crash.subjects.ranks == [1]


def test_ranks_that_all_keep_beating_are_not_crashed(tracker: hangs.HangTracker) -> None:
    for rank in range(4):
        tracker.observe_heartbeat(_beat(rank, 109.5, schema.RankState.COMPUTE))
    finding = tracker.check(110.0)
    assert finding is None or finding.kind == "hang"


def _steps_and_beats(lost: range) -> list[schema.Record]:
    """4 ranks, 1 s steps for 20 s; rank 1's heartbeats from second 6 to 12 are lost (its
    step records still arrive)."""
    out: list[schema.Record] = [schema.Job(job_id="j", name="j", world_size=4)]
    for step in range(20):
        for rank in range(4):
            out.append(schema.StepRecord(job_id="j", rank=rank, step=step,
                                         start_s=100.0 + step, end_s=100.9 + step))  # fmt: skip
    for second in range(20):
        for rank in range(4):
            if not (rank == 1 and second in lost):
                out.append(_beat(rank, 100.5 + second, schema.RankState.COMPUTE))
    return out


def test_a_rank_whose_steps_keep_arriving_is_alive_without_heartbeats() -> None:
    from vigil.analyzer import engine, streaming

    records = _steps_and_beats(lost=range(6, 13))
    assert engine.analyze_records(records) == []
    analyzer = streaming.StreamingAnalyzer()
    found = []
    for second in range(20):  # what a collector receives each second
        batch = [r for r in records if isinstance(r, schema.Job) or
                 getattr(r, "end_s", getattr(r, "time_s", 0.0)) // 1 == 100 + second]  # fmt: skip
        found += [*analyzer.observe(batch), *analyzer.tick(100.9 + second)]
    assert found == []


def test_a_rank_silent_in_steps_and_heartbeats_is_still_a_crash() -> None:
    from vigil.analyzer import engine

    records = [
        r
        for r in _steps_and_beats(lost=range(6, 20))
        if not (isinstance(r, schema.StepRecord) and r.rank == 1 and r.step >= 6)
    ]
    crash = [f for f in engine.analyze_records(records) if f.kind == "crash"]
    assert [f.subjects.ranks for f in crash] == [[1]]


def test_a_rank_that_died_before_sending_anything_is_the_culprit() -> None:
    t = hangs.HangTracker("j", config.HangConfig())
    t.expect_ranks(range(4))  # the job's declared world size
    for rank in (0, 1, 2):
        t.observe_heartbeat(_beat(rank, 100.0, schema.RankState.COMPUTE))
    t.observe_heartbeat(_beat(1, 101.0, schema.RankState.FAILED))
    t.observe_heartbeat(_beat(2, 101.1, schema.RankState.FAILED))
    t.observe_heartbeat(_beat(0, 102.0, schema.RankState.IN_COLLECTIVE))  # still waiting
    crash = t.check(104.5)
    assert crash is not None and crash.subjects.ranks == [3]


def _link_records(slow: float) -> list[schema.Record]:
    """A 2 x 2 mesh (dp groups {0, 2} and {1, 3}) over 20 steps; dp group {1, 3}'s ops take
    `slow` times as long, as when the link between their hosts is slow."""
    out: list[schema.Record] = []
    for rank, node in enumerate(["a", "a", "b", "b"]):
        out.append(schema.RankInfo(job_id="j", rank=rank, node=node))
    for step in range(20):
        for rank in range(4):
            out.append(
                schema.StepRecord(
                    job_id="j", rank=rank, step=step, start_s=step * 1.0, end_s=step * 1.0 + 0.9
                )
            )
            group = f"mesh_dp:{2 + rank % 2}"
            seconds = 0.1 * (slow if rank % 2 else 1.0)
            out.append(
                schema.CollectiveAggregate(
                    job_id="j",
                    rank=rank,
                    step=step,
                    group=group,
                    op="all_gather_single",
                    count=2,
                    bytes=2048,
                    total_device_s=seconds,
                    last_device_s=seconds / 2,
                    last_seq=2 * (step + 1),
                )
            )
    return out


def test_a_group_slower_than_its_peers_is_a_slow_link_between_its_hosts() -> None:
    from vigil.analyzer import engine

    [link] = engine.analyze_records(_link_records(slow=3.0))
    assert link.kind == "slow_link" and link.subjects.ranks == [1, 3]
    assert link.subjects.links == ["a<->b"]
    transfer = link.evidence[0]
    assert transfer.observed == pytest.approx(3 * transfer.baseline, rel=0.01)


def test_groups_moving_alike_are_no_slow_link() -> None:
    from vigil.analyzer import engine

    assert engine.analyze_records(_link_records(slow=1.2)) == []


def test_streaming_names_a_rank_that_died_before_sending_anything() -> None:
    from vigil.analyzer import streaming

    analyzer = streaming.StreamingAnalyzer()
    job = schema.Job(job_id="j", name="j", world_size=4)  # rank 0's, first: the window is sized
    steps = [
        schema.StepRecord(job_id="j", rank=r, step=s, start_s=100.0 + s, end_s=100.5 + s)
        for s in range(6)
        for r in range(3)
    ]
    analyzer.observe([job, *steps])
    analyzer.observe([_beat(r, 106.0, schema.RankState.COMPUTE) for r in range(3)])
    analyzer.observe([_beat(r, 106.4, schema.RankState.FAILED) for r in (1, 2)])
    analyzer.observe([_beat(0, 107.5, schema.RankState.IN_COLLECTIVE)])  # waits for rank 3
    found = [f for f in analyzer.tick(110.0) if f.kind == "crash"]
    assert [f.subjects.ranks for f in found] == [[3]]
