"""Hang detection around recoveries and asynchronous collectives (what `vigil demo` meets)."""

from __future__ import annotations

from vigil import schema
from vigil.analyzer import config as config_mod
from vigil.analyzer import hangs


def _tracker(step_s: float = 0.25, steps: int = 20) -> hangs.HangTracker:
    tracker = hangs.HangTracker("job", config_mod.HangConfig())
    for step in range(steps):
        tracker.observe_step_time(step, 100.0 + step * step_s, step_s)
    return tracker


def test_culprit_found_when_peers_block_in_waits_the_sdk_cannot_see() -> None:
    """dp x tp: rank 1 stopped before its step; ranks 0 (tp peer) and 3 (dp peer) went ahead."""
    seqs = {
        "mesh_tp:11": {0: 31, 1: 30},
        "mesh_tp:12": {2: 30, 3: 30},
        "mesh_dp:9": {0: 12, 2: 12},
        "mesh_dp:10": {1: 11, 3: 12},
    }
    culprits = hangs.find_culprits([], seqs, {0, 1, 2, 3})
    assert culprits is not None and culprits.ranks == (1,)
    assert (culprits.group, culprits.seq) in {("mesh_tp:11", 31), ("mesh_dp:10", 12)}
    # Everyone level: nobody can be blamed.
    assert hangs.behind_everywhere({"g": {0: 3, 1: 3}}) is None


def _behind(tracker: hangs.HangTracker) -> None:
    """Rank 1 of the new attempt is one collective behind rank 0: a culprit to name."""
    tracker.observe_seq(0, "world", 5, "all_reduce")
    tracker.observe_seq(1, "world", 4, "all_reduce")


def test_the_silence_of_a_restart_is_not_a_hang() -> None:
    tracker = _tracker()
    last = 100.0 + 19 * 0.25
    tracker.restarting(last + 0.5)
    _behind(tracker)
    assert tracker.check(last + 30.0) is None  # ranks are starting: warm-up threshold
    tracker.observe_progress(20, last + 31.0)  # the new attempt's first step
    assert tracker.check(last + 32.0) is None
    finding = tracker.check(last + 40.0)
    assert finding is not None and finding.kind is schema.FindingKind.HANG


def test_a_step_the_old_attempt_finishes_while_stopping_does_not_end_the_warm_up() -> None:
    tracker = _tracker()
    last = 100.0 + 19 * 0.25
    tracker.restarting(last + 0.5)
    _behind(tracker)
    # Started before the restart, ended just after it: the old ranks, not the new attempt.
    tracker.observe_progress(20, last + 0.6, start_s=last + 0.2)
    assert tracker.check(last + 10.0) is None  # still the warm-up threshold
    tracker.observe_progress(20, last + 12.0, start_s=last + 11.5)  # the new attempt's step
    assert tracker.check(last + 20.0) is not None


def test_restart_forgets_positions_of_the_previous_attempt() -> None:
    tracker = _tracker()
    tracker.observe_seq(0, "world", 500, "all_reduce")
    tracker.observe_seq(1, "world", 499, "all_reduce")
    tracker.restarting(200.0)
    tracker.observe_seq(0, "world", 3, "all_reduce")
    tracker.observe_seq(1, "world", 2, "all_reduce")
    tracker.observe_progress(21, 201.0)
    finding = tracker.check(260.0)
    assert finding is not None and finding.subjects.ranks == [1]


def test_a_job_that_just_turned_slow_is_not_hung() -> None:
    tracker = _tracker(step_s=0.25, steps=40)
    for step in range(40, 48):  # a straggler: steps now take 1.6 s
        tracker.observe_step_time(step, 110.0 + (step - 40) * 1.6, 1.6)
    last = 110.0 + 7 * 1.6
    assert tracker.threshold_s() >= 1.5 * 1.6
    assert tracker.check(last + 2.2) is None


def test_heartbeats_from_before_a_restart_are_ignored() -> None:
    tracker = _tracker()
    tracker.restarting(200.0)
    late_old = schema.Heartbeat(
        job_id="job",
        rank=1,
        time_s=199.0,
        last_group="world",
        last_seq=900,
        state=schema.RankState.COMPUTE,
    )
    tracker.observe_heartbeat(late_old)
    for rank, seq in ((0, 5), (1, 4)):
        tracker.observe_heartbeat(
            schema.Heartbeat(
                job_id="job",
                rank=rank,
                time_s=201.0,
                last_group="world",
                last_seq=seq,
                state=schema.RankState.IN_COLLECTIVE if rank == 0 else schema.RankState.COMPUTE,
            )
        )
    tracker.observe_progress(21, 201.5)
    finding = tracker.check(260.0)
    assert finding is not None and finding.subjects.ranks == [1]
