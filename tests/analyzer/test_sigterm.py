"""Crashes whose survivors a launcher stopped with SIGTERM (their last word `terminated`), and
jobs stopped from outside: who the crash names (the shapes of real torchrun jobs: when one rank
dies, torchrun stops the others within ~0.1 s, some before their collective breaks)."""

from __future__ import annotations

import pytest

from tests.support import beats as beats_mod
from vigil import schema
from vigil.analyzer import config, crashes, hangs

S = schema.RankState


def _job(ranks: int = 4) -> hangs.HangTracker:
    tracker = hangs.HangTracker("j", config.HangConfig())
    tracker.expect_ranks(range(ranks))
    for step in range(20):
        tracker.observe_step_time(step, 100.0 + 0.5 * step, 0.5)
    return tracker


def _beat(rank: int, t: float, state: schema.RankState = S.COMPUTE) -> schema.Heartbeat:
    return schema.Heartbeat(job_id="j", rank=rank, time_s=t, last_step=19, state=state)


def _feed(tracker: hangs.HangTracker, beats: list[schema.Heartbeat], batched: bool) -> None:
    beats_mod.feed(tracker, beats, batched=batched)


def _crash(tracker: hangs.HangTracker, now: float) -> schema.Finding | None:
    found = None
    for t in (now - 1.0, now):
        found = tracker.check(t) or found
    return found


@pytest.mark.parametrize("batched", [False, True])
def test_survivors_stopped_by_sigterm_are_not_the_culprits_of_a_killed_rank(
    batched: bool,
) -> None:
    tracker = _job()
    # Everyone beats until 109.6; rank 3 is killed at ~110.0 (no last word); rank 0's
    # all-reduce breaks (failed, 110.05); torchrun stops ranks 1 and 2 (terminated, 110.1).
    _feed(tracker, [_beat(r, 109.6) for r in range(4)], batched)
    _feed(tracker, [_beat(0, 110.05, S.FAILED)], batched)
    _feed(tracker, [_beat(1, 110.1, S.TERMINATED), _beat(2, 110.12, S.TERMINATED)], batched)
    crash = _crash(tracker, 114.0)
    assert crash is not None and crash.kind is schema.FindingKind.CRASH
    assert crash.subjects.ranks == [3], crash.summary
    assert "stopped without a last word" in crash.summary
    assert "1 rank(s) then failed; 2 rank(s) were then stopped by SIGTERM" in crash.summary


@pytest.mark.parametrize("batched", [False, True])
def test_the_rank_that_raised_is_named_not_the_survivors_stopped_after_it(batched: bool) -> None:
    tracker = _job()
    _feed(tracker, [_beat(r, 109.6) for r in range(4)], batched)
    _feed(tracker, [_beat(3, 110.0, S.FAILED)], batched)
    _feed(tracker, [_beat(r, 110.2, S.TERMINATED) for r in range(3)], batched)
    crash = _crash(tracker, 114.0)
    assert crash is not None and crash.subjects.ranks == [3], crash.summary
    assert crashes.FAILED_FIRST in crash.summary


@pytest.mark.parametrize("batched", [False, True])
def test_ranks_stopped_by_sigterm_before_any_failed_are_the_culprits(batched: bool) -> None:
    tracker = _job(8)
    # A drained node's four ranks are stopped; the others' collectives then break.
    _feed(tracker, [_beat(r, 109.6) for r in range(8)], batched)
    _feed(tracker, [_beat(r, 110.0 + 0.01 * r, S.TERMINATED) for r in range(4, 8)], batched)
    _feed(tracker, [_beat(r, 110.4, S.FAILED) for r in range(4)], batched)
    crash = _crash(tracker, 114.0)
    assert crash is not None and crash.subjects.ranks == [4, 5, 6, 7], crash.summary
    assert crashes.STOPPED_FIRST in crash.summary


@pytest.mark.parametrize("batched", [False, True])
def test_a_job_stopped_as_a_whole_by_sigterm_is_neither_crashed_nor_hung(batched: bool) -> None:
    tracker = _job()
    _feed(tracker, [_beat(r, 109.6) for r in range(4)], batched)
    _feed(tracker, [_beat(r, 110.0 + 0.01 * r, S.TERMINATED) for r in range(4)], batched)
    assert all(tracker.check(t) is None for t in (111.0, 114.0, 130.0, 200.0))


def test_a_rank_stopped_by_sigterm_while_its_peers_beat_is_the_culprit() -> None:
    tracker = _job()
    tracker.observe_heartbeats([_beat(r, 109.6) for r in range(4)])
    tracker.observe_heartbeat(_beat(2, 110.0, S.TERMINATED))
    found = None
    for t in range(111, 116):  # the peers wait for it, beating
        tracker.observe_heartbeats([_beat(r, float(t)) for r in (0, 1, 3)])
        found = tracker.check(float(t)) or found
    assert found is not None and found.kind is schema.FindingKind.CRASH
    assert found.subjects.ranks == [2], found.summary
