"""Ranks that called different collectives, a rank that left its loop early, and the crash
that ends a hang: who is named (a real DDP job's shapes: its all-reduce waits inside C++, so
its ranks say they compute while they wait in it)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import beats as beats_mod
from vigil import schema
from vigil.analyzer import config, hangs, waitgraph

CFG = config.HangConfig()
S = schema.RankState


def test_a_desync_names_the_ranks_outside_the_collective_most_members_entered() -> None:
    d = waitgraph.desync(
        "world", 31, {0: "all_reduce", 1: "all_reduce", 2: "all_reduce", 3: "barrier"}
    )
    assert d is not None and d.culprits == (3,) and d.resolved
    assert d.variants == (("all_reduce", (0, 1, 2)), ("barrier", (3,)))
    tie = waitgraph.desync("world", 4, {0: "all_reduce", 1: "barrier"})
    assert tie is not None and not tie.resolved and tie.culprits == (1,)
    assert waitgraph.desync("world", 31, dict.fromkeys(range(4), "all_reduce")) is None


def _job() -> hangs.HangTracker:
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    return tracker


def _beats(
    tracker: hangs.HangTracker,
    t: float,
    where: dict[int, tuple[str, int, str, schema.RankState]],
    *,
    batched: bool,
) -> None:
    beats = [
        schema.Heartbeat(
            job_id="j", rank=rank, time_s=t, last_step=9, last_group=group, last_seq=seq,
            last_op=op, state=state, between_steps=op == "barrier",
        )
        for rank, (group, seq, op, state) in where.items()
    ]  # fmt: skip
    beats_mod.feed(tracker, beats, batched=batched)


# Ranks 0-2 in step 10's DDP all-reduce (#31 of the world group; DDP waits in C++, so they say
# they compute); rank 3, whose data ran out, at the barrier after its loop, as its #31.
DESYNC = {
    **{r: ("world", 31, "ddp_all_reduce", S.COMPUTE) for r in range(3)},
    3: ("world", 31, "barrier", S.IN_COLLECTIVE),
}


@pytest.mark.parametrize("batched", [False, True])
def test_ranks_in_different_collectives_are_a_desync_naming_the_odd_one(batched: bool) -> None:
    tracker = _job()
    for t in np.arange(109.5, 114.0, 1.0):
        _beats(tracker, float(t), DESYNC, batched=batched)
    hang = tracker.check(109.0 + CFG.min_s + 0.5)
    assert hang is not None and hang.kind == "hang" and hang.subjects.ranks == [3], hang
    assert "desync at #31 of group 'world'" in hang.summary
    assert "rank(s) 0, 1, 2 entered ddp_all_reduce; rank(s) 3 entered barrier" in hang.summary
    # Its collective timeout then fails every rank: the crash names the hang's culprit, not
    # the first rank to give up.
    _beats(tracker, 170.0, {r: ("world", 31, "ddp_all_reduce", S.FAILED) for r in range(3)},
           batched=batched)  # fmt: skip
    _beats(tracker, 170.1, {3: ("world", 31, "barrier", S.FAILED)}, batched=batched)
    crash = tracker.check(175.0)
    assert crash is not None and crash.kind == "crash" and crash.subjects.ranks == [3], crash
    assert "hung, and its peers failed waiting for it" in crash.summary


def test_a_pairs_send_meeting_its_receive_is_no_desync() -> None:
    """A pipeline pair's n-th ops are a send on one side and a receive on the other."""
    tracker = _job()
    pair = "pp:p2p:1-2"
    where = {
        0: ("world", 40, "all_reduce", S.IN_COLLECTIVE),
        1: ("world", 40, "all_reduce", S.IN_COLLECTIVE),
        2: (pair, 7, "irecv", S.IN_COLLECTIVE),
        3: ("world", 39, "all_reduce", S.COMPUTE),
    }
    for t in np.arange(109.5, 114.0, 1.0):
        _beats(tracker, float(t), where, batched=False)
    tracker.observe_seq(1, pair, 7, "isend")
    tracker.observe_seq(2, "world", 40, "all_reduce")
    hang = tracker.check(109.0 + CFG.min_s + 0.5)
    assert hang is not None and "desync" not in hang.summary
    assert hang.subjects.ranks == [3], hang


def test_a_rank_that_left_its_loop_early_is_named_when_its_peers_fail() -> None:
    """Rank 3's data ran out after step 29: it finished and tore its process group down while
    its peers entered step 30's all-reduce (#31), which then failed."""
    tracker = _job()
    for rank in range(3):
        tracker.observe_heartbeat(schema.Heartbeat(
            job_id="j", rank=rank, time_s=110.0, last_step=10, last_group="world", last_seq=31,
            last_op="ddp_all_reduce", state=S.COMPUTE,
        ))  # fmt: skip
    tracker.observe_heartbeat(schema.Heartbeat(
        job_id="j", rank=3, time_s=109.6, last_step=9, last_group="world", last_seq=30,
        last_op="ddp_all_reduce", state=S.FINISHED,
    ))  # fmt: skip
    tracker.observe_heartbeat(schema.Heartbeat(job_id="j", rank=0, time_s=110.2, state=S.FAILED))
    for rank in (1, 2):
        tracker.observe_heartbeat(
            schema.Heartbeat(job_id="j", rank=rank, time_s=110.4, state=S.FAILED)
        )
    crash = tracker.check(114.0)
    assert crash is not None and crash.kind == "crash" and crash.subjects.ranks == [3], crash
    assert "finished early" in crash.summary


def test_ranks_that_finished_together_leave_the_crash_to_the_first_to_fail() -> None:
    """Every rank finished its loop at #31, then rank 0 failed in code after it: its own."""
    tracker = _job()
    for rank in range(4):
        tracker.observe_heartbeat(schema.Heartbeat(
            job_id="j", rank=rank, time_s=110.0, last_step=10, last_group="world", last_seq=31,
            last_op="ddp_all_reduce", state=S.FINISHED if rank else S.COMPUTE,
        ))  # fmt: skip
    tracker.observe_heartbeat(schema.Heartbeat(job_id="j", rank=0, time_s=111.0, state=S.FAILED))
    crash = tracker.check(115.0)
    assert crash is not None and crash.subjects.ranks == [0], crash
    assert "failed first" in crash.summary


def test_a_crash_after_a_hang_with_no_culprit_names_the_first_to_fail() -> None:
    tracker = _job()
    for t in np.arange(109.5, 140.0, 1.0):  # every rank in the same all-reduce, nobody behind
        _beats(tracker, float(t), {r: ("world", 31, "all_reduce", S.IN_COLLECTIVE)
                                   for r in range(4)}, batched=True)  # fmt: skip
    hang = tracker.check(139.9)
    assert hang is not None and hang.subjects.ranks == []
    assert "4 rank(s) wait in collectives every member entered" in hang.summary
    _beats(tracker, 140.0, {1: ("world", 31, "all_reduce", S.FAILED)}, batched=True)
    _beats(tracker, 140.5, {r: ("world", 31, "all_reduce", S.FAILED) for r in (0, 2, 3)},
           batched=True)  # fmt: skip
    crash = tracker.check(144.0)
    assert crash is not None and crash.subjects.ranks == [1], crash


@pytest.mark.parametrize("batched", [False, True])
def test_a_job_its_launcher_restarted_gets_its_hangs_tracked_again(batched: bool) -> None:
    """torchrun --max-restarts relaunches every rank after rank 3 was killed (no restart action
    reaches vigil): once rank 3 beats again, the new attempt's stall is a hang of its own."""
    tracker = _job()
    _beats(tracker, 109.5, {r: ("world", 31, "all_reduce", S.COMPUTE) for r in range(4)},
           batched=batched)  # fmt: skip
    _beats(tracker, 110.2, {r: ("world", 31, "all_reduce", S.FAILED) for r in range(3)},
           batched=batched)  # fmt: skip
    crash = tracker.check(114.0)
    assert crash is not None and crash.kind == "crash" and crash.subjects.ranks == [3]
    # Attempt 1 from step 0: its ranks count their collectives from scratch.
    for step in range(10):
        tracker.observe_step_time(step, 120.0 + step, 1.0, 119.2 + step)
        _beats(tracker, 120.0 + step, {r: ("world", 2 * step + 1, "all_reduce", S.COMPUTE)
                                       for r in range(4)}, batched=batched)  # fmt: skip
    stuck = {r: ("world", 21, "all_reduce", S.IN_COLLECTIVE) for r in (0, 2, 3)}
    stuck[1] = ("world", 19, "all_reduce", S.COMPUTE)
    for t in np.arange(129.5, 135.0, 1.0):
        _beats(tracker, float(t), stuck, batched=batched)
    hang = tracker.check(129.0 + CFG.min_s + 0.5)
    assert hang is not None and hang.kind == "hang" and hang.subjects.ranks == [1], hang
