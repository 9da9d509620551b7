"""Hang detection: learned thresholds, the wait-for graph, and the streaming tick."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import beats as beats_mod
from tests.support import simulator as sim
from vigil import schema
from vigil.analyzer import config, hangs, streaming

CFG = config.HangConfig()


def test_threshold_is_learned_from_recent_step_times() -> None:
    assert hangs.learned_threshold_s([1.0] * 3, CFG) == CFG.warmup_s  # still warming up
    assert hangs.learned_threshold_s([4.0] * 10, CFG) == pytest.approx(CFG.factor * 4.0)
    assert hangs.learned_threshold_s([0.1] * 10, CFG) == CFG.min_s  # never below the floor


def test_wait_graph_follows_waiting_ranks_to_the_culprit() -> None:
    # Rank 3 never entered tp group "tp1" #7; rank 2 waits there; ranks 0-1 wait in dp #5.
    seqs = {"dp": {0: 5, 1: 5, 2: 4, 3: 4}, "tp1": {2: 7, 3: 6}}
    waits = [
        hangs.Wait(rank=0, group="dp", seq=5, op="all_reduce"),
        hangs.Wait(rank=1, group="dp", seq=5, op="all_reduce"),
        hangs.Wait(rank=2, group="tp1", seq=7, op="all_gather"),
    ]
    culprits = hangs.find_culprits(waits, seqs, {0, 1, 2, 3})
    assert culprits is not None and culprits.ranks == (3,) and culprits.resolved
    assert (culprits.group, culprits.seq, culprits.op) == ("tp1", 7, "all_gather")


def _hang_scenario(collective: int, ranks: int = 32) -> sim.Simulation:
    """Rank 13 hangs at step 30. Steps take about 3.2 s, so the learned threshold (2.5x the
    median step time, about 8 s) is well above the 4 s floor and decides when a hang is due."""
    faults = (sim.Fault(kind=sim.FaultKind.HANG, rank=13, collective=collective, start_step=30),)
    config = sim.ScenarioConfig(num_ranks=ranks, num_steps=60, compute_s=3.0, faults=faults, seed=2)
    return sim.simulate(config)


TICK_S = 0.25  # how often the test lets time pass


@pytest.mark.parametrize(("collective", "group"), [(0, "tp1"), (1, "tp1"), (2, "dp")])
def test_streaming_hang_found_in_time_with_culprit(collective: int, group: str) -> None:
    s = _hang_scenario(collective)
    assert s.hang is not None
    analyzer = streaming.StreamingAnalyzer()
    for batch in s.records():
        assert [f for f in analyzer.observe(batch) if f.kind == "hang"] == []
    # HangConfig: a hang is declared after 2.5x the median recent step time without progress.
    median_step_s = float(np.median(s.arrays.step_time_s))
    due_s = CFG.factor * median_step_s
    assert due_s > CFG.min_s + 2.0  # the learned part decides, not the floor
    found, waited_s = None, 0.0
    while found is None and waited_s < 30.0:
        waited_s += TICK_S
        # Heartbeats keep arriving during a hang: either they or the tick raise it.
        t = s.hang.onset_s + waited_s
        raised = [*analyzer.observe(s.positions_at(t)), *analyzer.tick(t)]
        found = next(iter(raised), None)
    assert found is not None
    # Not before it is due (a shorter threshold would page on a slow step), and at the first
    # tick after it (a longer one, e.g. 3x the median or a fixed 5 s budget, is late).
    assert 0.97 * due_s <= waited_s <= due_s + TICK_S + 0.05, (waited_s, due_s)
    assert found.subjects.ranks == [13] and found.step_start == 30
    assert f"of group '{group}'" in found.summary
    silence = next(e for e in found.evidence if e.metric == "seconds_without_progress")
    assert silence.baseline == pytest.approx(due_s, rel=0.01)


def test_no_hang_while_steps_keep_finishing_or_after_the_job_finished() -> None:
    s = sim.simulate(sim.ScenarioConfig(num_ranks=16, num_steps=30, seed=3))
    analyzer = streaming.StreamingAnalyzer()
    for batch in s.records():
        analyzer.observe(batch)
    end = float(s.arrays.step_end_s[-1])
    assert analyzer.tick(end + 1.0) == []
    done = [
        schema.Heartbeat(job_id="sim", rank=r, time_s=end + 1.5, state=schema.RankState.FINISHED)
        for r in range(16)
    ]
    assert [f for f in analyzer.observe(done) if f.kind == "hang"] == []
    assert analyzer.tick(end + 60.0) == []


def test_hang_resolves_when_progress_resumes() -> None:
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    tracker.observe_seq(0, "world", 11, "all_reduce")
    tracker.observe_seq(1, "world", 10, "all_reduce")
    hang = tracker.check(115.0)
    assert hang is not None and hang.state == "open" and hang.subjects.ranks == [1]
    tracker.observe_progress(10, 116.0)
    resolved = tracker.check(116.5)
    assert resolved is not None and resolved.state == "resolved"
    assert resolved.finding_id == hang.finding_id


def test_a_stall_nobody_can_be_named_for_waits_several_thresholds() -> None:
    """Steps of 1 s, every rank level in every group and none waiting: at one threshold this
    is a long step (one rank's 3x hiccup looks exactly so), not a hang without a culprit."""
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    for rank in range(4):
        tracker.observe_seq(rank, "world", 10, "all_reduce")
    threshold = tracker.threshold_s()
    assert threshold == pytest.approx(CFG.min_s)
    for waited in np.arange(0.5, CFG.unknown_culprit_factor * threshold, 0.5):
        assert tracker.check(109.0 + waited) is None, waited
    stall = tracker.check(109.0 + CFG.unknown_culprit_factor * threshold + 0.5)
    assert stall is not None and stall.subjects.ranks == [] and "culprit unknown" in stall.summary
    assert stall.confidence == 0.5


def test_one_ranks_hiccup_on_short_steps_is_no_hang() -> None:
    """~1.1 s steps; one rank's 3x hiccup holds every rank for 3.3 s (its peers wait for it in
    the collective): under the threshold, so nothing is raised while positions name it."""
    tracker = hangs.HangTracker("j", CFG)
    for step in range(20):
        tracker.observe_step_time(step, 100.0 + 1.1 * step, 1.1)
    last = 100.0 + 1.1 * 19
    for t in np.arange(last + 0.5, last + 3.3, 0.25):
        for rank in range(4):
            state = schema.RankState.COMPUTE if rank == 2 else schema.RankState.IN_COLLECTIVE
            seq = 19 if rank == 2 else 20
            beat = schema.Heartbeat(job_id="j", rank=rank, time_s=float(t), last_step=19,
                                    last_group="world", last_seq=seq, state=state)  # fmt: skip
            tracker.observe_heartbeat(beat)
        assert tracker.check(float(t)) is None, t
    tracker.observe_progress(20, last + 3.3)
    assert tracker.check(last + 3.5) is None


def test_checkpointing_ranks_get_the_long_threshold_and_late_aggregates_keep_waits() -> None:
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    saving = schema.Heartbeat(
        job_id="j", rank=0, time_s=110.0, state=schema.RankState.CHECKPOINTING
    )
    tracker.observe_heartbeat(saving)
    assert tracker.threshold_s() == CFG.warmup_s and tracker.check(150.0) is None
    for t in (151.0, 153.0):
        for rank, seq, state in (
            (0, 11, schema.RankState.IN_COLLECTIVE),
            (1, 10, schema.RankState.COMPUTE),
        ):
            tracker.observe_heartbeat(
                schema.Heartbeat(
                    job_id="j", rank=rank, time_s=t, last_group="dp", last_seq=seq, state=state
                )
            )
        if t == 151.0:
            tracker.observe_seq(0, "dp", 10, "all_reduce")  # a finished step's aggregate, late
            assert tracker.threshold_s() == pytest.approx(CFG.min_s)
            # The save is over: silence counts from then (the last check that saw it).
            assert tracker.check(152.0) is None
    hang = tracker.check(150.0 + CFG.min_s + 0.5)
    assert hang is not None and hang.subjects.ranks == [1]


def _saving_job(
    culprit_done: int, peers_done: int, peers: schema.RankState, *, between: bool = False
) -> hangs.HangTracker:
    """1 s steps, then rank 1 checkpointing (having finished `culprit_done` saves) while ranks
    0, 2, 3 (having finished `peers_done`) are in state `peers` at the barrier after the save
    (`between`: their heartbeats say they are between steps, as the SDK's do there)."""
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    for t in np.arange(109.5, 130.0, 1.0):
        for rank in range(4):
            behind = rank == 1
            beat = schema.Heartbeat(
                job_id="j", rank=rank, time_s=float(t), last_step=9, last_group="world",
                last_seq=20 if behind else 21, last_op="barrier",
                state=schema.RankState.CHECKPOINTING if behind else peers,
                checkpoints=culprit_done if behind else peers_done,
                between_steps=between,
            )  # fmt: skip
            tracker.observe_heartbeat(beat)
    return tracker


@pytest.mark.parametrize("between", [False, True])
def test_a_rank_stuck_in_a_save_its_peers_finished_is_hung(between: bool) -> None:
    """Every rank saved; ranks 0, 2, 3 finished (their heartbeats count it) and wait at the
    barrier after it, rank 1 is still in its save: its silence counts like any other, also
    when the save is between steps (peers waiting there wait for it, they hold nothing up)."""
    tracker = _saving_job(0, 1, schema.RankState.IN_COLLECTIVE, between=between)
    assert tracker.threshold_s() == pytest.approx(CFG.min_s)
    assert tracker.check(109.0 + CFG.min_s - 0.5) is None
    hang = tracker.check(109.0 + CFG.min_s + 0.5)
    assert hang is not None and hang.subjects.ranks == [1], hang
    # A heartbeat resent late with an older count does not undo the peers' finished save.
    late = schema.Heartbeat(job_id="j", rank=0, time_s=105.0, checkpoints=0)
    tracker.observe_heartbeat(late)
    assert tracker.threshold_s() == pytest.approx(CFG.min_s)


def _save_one_rank_never_finishes(peers_save_s: float, until_s: float) -> list[float]:
    """1 s steps to 109 s, then every rank in a checkpoint span; ranks 0, 2, 3 finish theirs
    after `peers_save_s` and wait at the barrier after it, rank 1 never does. Heartbeats every
    0.5 s, each checked as it comes (as the offline replay does). When a hang was found, with
    its due time as each check left it."""
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    found = []
    for t in np.arange(109.5, until_s, 0.5):
        for rank in range(4):
            done = rank != 1 and t >= 109.0 + peers_save_s
            beat = schema.Heartbeat(
                job_id="j", rank=rank, time_s=float(t), last_step=9, last_group="world",
                last_seq=21 if done else 20, last_op="barrier",
                state=schema.RankState.IN_COLLECTIVE if done else schema.RankState.CHECKPOINTING,
                checkpoints=int(done), between_steps=True,
            )  # fmt: skip
            tracker.observe_heartbeat(beat)
        due = tracker.due_s()
        hang = tracker.check(float(t))
        if hang is not None:
            assert hang.subjects.ranks == [1], hang
            found.append(float(t))
        if due is not None and due < t + 0.5 and not found:
            hang = tracker.check(due)  # as the replay and the collector check at due
            assert hang is not None and hang.subjects.ranks == [1], (due, hang)
            found.append(due)
    return found


def test_a_rank_stuck_in_a_save_is_hung_a_threshold_after_the_step_before_it() -> None:
    """Every rank saved for 1.5 s and rank 1 never finished: its save began with theirs, so it
    is hung a threshold after the last step ended, not a threshold after the peers' saves."""
    found = _save_one_rank_never_finishes(1.5, 120.0)
    assert found and found[0] == pytest.approx(109.0 + CFG.min_s, abs=0.02), found


def test_a_rank_whose_long_save_takes_longer_than_its_peers_is_not_hung_too_soon() -> None:
    """The peers' saves took 20 s: rank 1's save is hung once it has lasted twice as long (a
    threshold past the peers' saves is storage skew on a save this long)."""
    found = _save_one_rank_never_finishes(20.0, 160.0)
    # The last check that saw the peers saving was at 128.5 s: 19.5 s of save, 39 s of allowance.
    assert found and found[0] == pytest.approx(109.0 + 2 * 19.5, abs=0.02), found


@pytest.mark.parametrize("peers", [schema.RankState.IN_COLLECTIVE, schema.RankState.CHECKPOINTING])
def test_a_save_no_peer_has_finished_gets_the_long_threshold(peers: schema.RankState) -> None:
    """Rank 1 alone saves while its peers wait at the barrier (rank 0 writing the whole
    state is the common case), or every rank is still saving: a long save, not a hang."""
    tracker = _saving_job(3, 3, peers)
    assert tracker.threshold_s() == CFG.warmup_s
    assert tracker.check(109.0 + 10 * CFG.min_s) is None


def _outside_job(
    outside: dict[int, schema.RankState],
    *,
    batched: bool,
    until: float = 130.0,
    others_between: bool = False,
) -> hangs.HangTracker:
    """1 s steps to step 9 (seq 20 of `world`), then heartbeats every second to `until`: the ranks
    of `outside` between steps in the given state, the others waiting in collective #21: in
    step 10's all-reduce, or (`others_between`) at a barrier between steps (`batched`: each
    second's heartbeats as the collector's batches)."""
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    for t in np.arange(109.5, until, 1.0):
        beats = [
            schema.Heartbeat(
                job_id="j", rank=rank, time_s=float(t), last_step=9, last_group="world",
                last_seq=20 if rank in outside else 21, last_op="all_reduce",
                state=outside.get(rank, schema.RankState.IN_COLLECTIVE),
                between_steps=rank in outside or others_between,
            )
            for rank in range(4)
        ]  # fmt: skip
        beats_mod.feed(tracker, beats, batched=batched)
    return tracker


@pytest.mark.parametrize("batched", [False, True])
def test_a_rank_holding_its_peers_up_from_between_steps_is_hung_as_usual(batched: bool) -> None:
    """Rank 1 stops before its step 10 (a hang, or a save without a checkpoint span) while its
    peers wait in step 10: the learned threshold, and the finding says where rank 1 is."""
    tracker = _outside_job({1: schema.RankState.COMPUTE}, batched=batched)
    assert tracker.threshold_s() == pytest.approx(CFG.min_s)
    hang = tracker.check(109.0 + CFG.min_s + 0.5)
    assert hang is not None and hang.subjects.ranks == [1], hang
    assert "rank(s) 1 between steps" in hang.summary


@pytest.mark.parametrize("batched", [False, True])
def test_a_save_rank_0_makes_while_its_peers_wait_at_a_barrier_is_no_hang(batched: bool) -> None:
    """Rank 0 saves without a checkpoint span after step 9 (slow storage) while its peers wait
    at the barrier after it, every rank between steps: the loop's own code, given the start-up
    grace; past it, a hang naming rank 0 that says where it is."""
    end = 109.0 + CFG.warmup_s + 1.0
    tracker = _outside_job(
        {0: schema.RankState.COMPUTE}, batched=batched, until=end, others_between=True
    )
    assert tracker.threshold_s() == CFG.warmup_s
    assert tracker.check(109.0 + 10 * CFG.min_s) is None
    hang = tracker.check(end)
    assert hang is not None and hang.subjects.ranks == [0], hang
    assert "rank(s) 0 between steps" in hang.summary


@pytest.mark.parametrize("batched", [False, True])
def test_an_evaluation_every_rank_runs_between_steps_is_no_hang(batched: bool) -> None:
    """Every rank evaluates between steps for longer than several thresholds: no hang."""
    tracker = _outside_job(dict.fromkeys(range(4), schema.RankState.COMPUTE), batched=batched)
    assert tracker.threshold_s() == CFG.warmup_s
    assert tracker.check(109.0 + CFG.unknown_culprit_factor * CFG.min_s + 1.0) is None


@pytest.mark.parametrize("batched", [False, True])
def test_data_loading_between_steps_is_the_next_steps_work(batched: bool) -> None:
    """A rank stuck in a "data" span before its step (the loop loads outside the step) holds
    the job up in training work: the learned threshold holds, and it is named."""
    tracker = _outside_job({2: schema.RankState.DATA}, batched=batched)
    assert tracker.threshold_s() == pytest.approx(CFG.min_s)
    hang = tracker.check(109.0 + CFG.min_s + 0.5)
    assert hang is not None and hang.subjects.ranks == [2], hang
    assert "between steps" not in hang.summary


@pytest.mark.parametrize("batched", [False, True])
def test_a_rank_recompiling_in_its_step_is_not_hung(batched: bool) -> None:
    """Rank 3's torch.compile recompiles in step 10 (a new input shape) while its peers wait
    in the step's all-reduce: the start-up grace, then a hang that says it was compiling."""
    tracker = hangs.HangTracker("j", CFG)
    for step in range(10):
        tracker.observe_step_time(step, 100.0 + step, 1.0)
    end = 109.0 + CFG.warmup_s + 1.0
    for t in np.arange(109.5, end, 1.0):
        beats = [
            schema.Heartbeat(
                job_id="j", rank=rank, time_s=float(t), last_step=9, last_group="world",
                last_seq=20 if rank == 3 else 21, last_op="all_reduce",
                state=schema.RankState.COMPUTE if rank == 3 else schema.RankState.IN_COLLECTIVE,
                compiling=rank == 3,
            )
            for rank in range(4)
        ]  # fmt: skip
        beats_mod.feed(tracker, beats, batched=batched)
        if t < 109.0 + 10 * CFG.min_s:
            assert tracker.check(float(t)) is None, t
    assert tracker.threshold_s() == CFG.warmup_s
    hang = tracker.check(end)
    assert hang is not None and hang.subjects.ranks == [3], hang
    assert "rank(s) 3 compiling" in hang.summary
    done = schema.Heartbeat(job_id="j", rank=3, time_s=end + 0.5, last_step=9, last_group="world",
                            last_seq=20)  # fmt: skip
    tracker.observe_heartbeat(done)
    assert tracker.threshold_s() == pytest.approx(CFG.min_s)


def test_ranks_blocked_in_waits_the_sdk_cannot_see_are_victims_not_culprits() -> None:
    """dp x tp after a migration (tp groups {0,1} and {2,3}, dp groups {0,2} and {1,3}): rank 1
    hangs before step k. Rank 0 launched step k's tensor-parallel collective and blocks in its
    asynchronous wait (not reported); rank 2 waits visibly in the dp collective rank 0 never
    reached; rank 3 blocks invisibly too. The wait graph alone names rank 0, a victim."""
    seqs = {
        "tp01": {0: 40, 1: 39},
        "tp23": {2: 41, 3: 41},
        "dp02": {0: 20, 2: 21},
        "dp13": {1: 20, 3: 21},
    }
    waits = [hangs.Wait(rank=2, group="dp02", seq=21, op="all_gather_single")]
    culprits = hangs.find_culprits(waits, seqs, {0, 1, 2, 3})
    assert culprits is not None and culprits.ranks == (1,)
    assert culprits.num_waiting == 1
    # With rank 0's wait visible as well, the wait graph reaches rank 1 directly.
    waits.append(hangs.Wait(rank=0, group="tp01", seq=40, op="all_reduce"))
    both = hangs.find_culprits(waits, seqs, {0, 1, 2, 3})
    assert both is not None and both.ranks == (1,) and both.group == "tp01"


def test_a_job_whose_steps_often_hiccup_still_gets_its_hangs_in_time() -> None:
    """128 ranks, ~1.35 s steps, and one step in eight holding some rank's 2.5x hiccup: the
    threshold rides over those steps and still leaves a heartbeat (1 s) inside the latency
    target, max(3 x the step time, 5 s)."""
    times = [3.4 if i % 8 == 0 else 1.35 for i in range(50)]
    threshold = hangs.learned_threshold_s(times, CFG)
    assert threshold > 3.4 * 1.2  # well past the job's own slow steps
    assert threshold + 0.5 <= max(3 * 1.35, 5.0)
