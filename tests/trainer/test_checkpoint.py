"""Checkpoints: stop at step k and resume exactly; keep-last-K; resume onto another dp size.

One launch of 4 real gloo CPU ranks runs the interrupted/uninterrupted pairs; the resharding
check also resumes a 4-rank FSDP checkpoint in this process alone (dp 4 -> 1).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer import workers
from vigil.trainer import checkpoint, loop

LOSS_ATOL = 2e-4  # across layouts (see test_layouts); the same layout must match exactly


def _losses(result: dict[str, object]) -> dict[int, float]:
    return {int(k): v for k, v in result["losses"].items()}  # type: ignore[attr-defined]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_resume_continues_the_loss_trajectory_and_reshards(tmp_path: Path) -> None:
    base = workers.small_recipe()
    dir_a, dir_b = tmp_path / "ckpt-a", tmp_path / "ckpt-b"
    dp_tp = workers.with_parallel(base, dp=2, tp=2)
    saving_dp_tp = workers.with_checkpoint(dp_tp, directory=dir_a, interval_steps=2, keep_last=3)
    fsdp4 = workers.with_checkpoint(
        workers.with_parallel(base, dp=4), directory=dir_b, interval_steps=2, keep_last=5
    )
    dp_pp = workers.with_parallel(fsdp4, dp=2, pp=2)
    cases = [
        workers.Case(name="uninterrupted", recipe=dp_tp),
        workers.Case(name="first_half", recipe=saving_dp_tp, stop_after=5),
        workers.Case(name="second_half", recipe=saving_dp_tp),
        workers.Case(name="fsdp4_first", recipe=fsdp4, stop_after=5),
        workers.Case(name="dp_pp_resumed", recipe=dp_pp, stop_after=8),
    ]
    results = workers.run_cases(4, cases, tmp_path / "out")
    full = _losses(results["uninterrupted"])

    # Same layout: the resumed run continues the uninterrupted trajectory exactly.
    assert results["second_half"]["start_step"] == 5
    resumed = _losses(results["second_half"])
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    for step, value in resumed.items():
        assert value == pytest.approx(full[step], abs=1e-6), step
    # keep-last-3 pruned the older saves; every survivor is committed and verifies.
    assert checkpoint.committed_steps(dir_a) == [6, 8, 10]
    assert all(checkpoint.verify(checkpoint.step_dir(dir_a, s)) for s in (6, 8, 10))

    # Another layout and dp size (FSDP dp=4 -> FSDP dp=2 x pp=2) resumes from the same point.
    reference = workers.reference_losses(base).losses
    assert results["dp_pp_resumed"]["start_step"] == 5
    for step, value in _losses(results["dp_pp_resumed"]).items():
        assert value == pytest.approx(reference[step], abs=LOSS_ATOL), step

    # dp=4 -> a single process: load the 4-rank step-5 checkpoint alone.
    alone = tmp_path / "alone"
    shutil.copytree(checkpoint.step_dir(dir_b, 5), checkpoint.step_dir(alone, 5))
    single = workers.with_checkpoint(base, directory=alone)
    with loop.trainer_session(single, ctx=loop.RunContext()) as trainer:
        result = trainer.train()
    assert result.start_step == 5
    for step, value in result.losses.items():
        assert value == pytest.approx(reference[step], abs=LOSS_ATOL), step
