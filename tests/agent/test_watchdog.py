"""The watchdog learns a rank's pace and flags a stall once, not before the learned threshold."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vigil import schema
from vigil.agent import progress, watchdog


def _snap(
    step: int, step_time: float, progress_at: float, **changes: object
) -> progress.PageSnapshot:
    snap = progress.PageSnapshot(
        path=Path("p"),
        job="j",
        node="n",
        rank=1,
        world_size=2,
        local_rank=1,
        pid=1,
        capacity=16,
        state=schema.RankState.COMPUTE,
        last_step=step,
        progress_mono_s=progress_at,
        progress_wall_s=0.0,
        step_start_mono_s=progress_at,
        last_group="world",
        last_seq=step,
        last_op="all_reduce",
        ring_head=step,
        last=progress.StepSummary(step=step, step_time_s=step_time),
        health=progress.Health(),
    )
    return dataclasses.replace(snap, **changes)  # type: ignore[arg-type]


def test_threshold_is_learned_from_recent_steps() -> None:
    dog = watchdog.Watchdog(hang_factor=5.0, min_hang_s=1.0, startup_grace_s=100.0)
    assert dog.threshold_s("j", 1) == 100.0  # before any step: the startup grace
    for step in range(5):
        dog.observe(_snap(step, 0.5 + 0.1 * step, 10.0 + step), 10.0 + step)
    assert dog.threshold_s("j", 1) == 5.0 * 0.9
    dog.observe(_snap(5, 0.01, 20.0), 20.0)
    assert dog.threshold_s("j", 1) == 4.5  # the slowest recent step still counts


def test_a_stall_is_flagged_once_after_the_threshold() -> None:
    dog = watchdog.Watchdog(hang_factor=3.0, min_hang_s=2.0, startup_grace_s=100.0)
    dog.observe(_snap(0, 1.0, 50.0), 50.0)  # threshold 3 s
    assert dog.observe(_snap(0, 1.0, 50.0), 52.9) is None
    suspect = dog.observe(_snap(0, 1.0, 50.0), 53.5)
    assert suspect is not None and suspect.threshold_s == 3.0 and suspect.stalled_s == 3.5
    assert dog.observe(_snap(0, 1.0, 50.0), 60.0) is None  # same stall: not again
    dog.observe(_snap(1, 1.0, 61.0), 61.0)  # progress resumes ...
    assert dog.observe(_snap(1, 1.0, 61.0), 70.0) is not None  # ... and stalls anew


def test_min_threshold_and_finished_ranks() -> None:
    dog = watchdog.Watchdog(hang_factor=3.0, min_hang_s=30.0, startup_grace_s=100.0)
    dog.observe(_snap(0, 0.1, 50.0), 50.0)
    assert dog.observe(_snap(0, 0.1, 50.0), 75.0) is None  # 3 x 0.1 s is below the 30 s floor
    finished = _snap(0, 0.1, 50.0, state=schema.RankState.FINISHED)
    assert dog.observe(finished, 500.0) is None


def test_a_rank_computing_between_steps_gets_the_startup_grace() -> None:
    """Between steps a computing rank runs its loop's own code (an evaluation, a save): its
    silence is not a hang until the startup grace; waiting in a collective there, it waits
    for a peer, and the learned threshold holds."""
    dog = watchdog.Watchdog(hang_factor=3.0, min_hang_s=2.0, startup_grace_s=100.0)
    dog.observe(_snap(0, 1.0, 50.0), 50.0)  # threshold 3 s
    outside = _snap(0, 1.0, 50.0, between_steps=True)
    assert dog.observe(outside, 60.0) is None
    suspect = dog.observe(outside, 151.0)
    assert suspect is not None and suspect.threshold_s == 100.0
    waiting = _snap(1, 1.0, 160.0, between_steps=True, state=schema.RankState.IN_COLLECTIVE)
    dog.observe(_snap(1, 1.0, 160.0), 160.0)
    suspect = dog.observe(waiting, 163.5)
    assert suspect is not None and suspect.threshold_s == 3.0


def test_a_rank_whose_torch_compile_compiles_gets_the_startup_grace() -> None:
    dog = watchdog.Watchdog(hang_factor=3.0, min_hang_s=2.0, startup_grace_s=100.0)
    dog.observe(_snap(0, 1.0, 50.0), 50.0)
    compiling = _snap(0, 1.0, 50.0, compiling=True)
    assert dog.observe(compiling, 60.0) is None
    suspect = dog.observe(compiling, 151.0)
    assert suspect is not None and suspect.threshold_s == 100.0
