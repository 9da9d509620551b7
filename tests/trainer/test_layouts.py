"""Every parallel layout trains with falling loss and matches a single-process reference run.

One launch of 4 real gloo CPU ranks runs all layouts in turn (each builds its own DeviceMesh).
Tolerance: fp32 on CPU; layouts only reorder reductions and split matmuls, so per-step losses
agree with the reference to LOSS_ATOL (observed differences are ~1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer import workers
from vigil.trainer import recipes

LOSS_ATOL = 2e-4
DDP = recipes.DataParallel.DDP
HSDP = recipes.DataParallel.HSDP
GPIPE = recipes.PipelineSchedule.GPIPE
INTERLEAVED = recipes.PipelineSchedule.INTERLEAVED_1F1B


def _cases() -> list[workers.Case]:
    base = workers.small_recipe()
    par = workers.with_parallel
    full = recipes.ActivationCheckpoint.FULL
    selective = recipes.ActivationCheckpoint.SELECTIVE
    return [
        workers.Case(name="ddp", recipe=par(base, dp=4, data_parallel=DDP)),
        # gradient accumulation: 2 sequences per forward, 2 forwards per step on each rank
        workers.Case(
            name="ddp_accum", recipe=par(base.replace(micro_batch=1), dp=4, data_parallel=DDP)
        ),
        workers.Case(name="fsdp", recipe=par(base.replace(activation_checkpoint=full), dp=4)),
        workers.Case(name="hsdp", recipe=par(base, dp=2, dp_replicate=2, data_parallel=HSDP)),
        workers.Case(name="tp", recipe=par(base, tp=4)),
        workers.Case(name="pp_1f1b", recipe=par(base, pp=4)),
        workers.Case(
            name="dp_tp", recipe=par(base.replace(activation_checkpoint=selective), dp=2, tp=2)
        ),
        workers.Case(name="dp_pp", recipe=par(base, dp=2, pp=2)),
        workers.Case(name="tp_pp_gpipe", recipe=par(base, tp=2, pp=2, pipeline_schedule=GPIPE)),
        workers.Case(
            name="dp_pp_interleaved",
            recipe=par(base, dp=2, pp=2, stages_per_rank=2, pipeline_schedule=INTERLEAVED),
        ),
    ]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_every_layout_matches_the_single_process_reference(tmp_path: Path) -> None:
    cases = _cases()
    results = workers.run_cases(4, cases, tmp_path)
    reference = workers.reference_losses(workers.small_recipe()).losses
    ref_accum = workers.reference_losses(workers.small_recipe(micro_batch=1)).losses
    assert reference[10] < reference[1] - 0.5, f"reference loss did not fall: {reference}"
    for case in cases:
        losses = {int(k): v for k, v in results[case.name]["losses"].items()}  # type: ignore[union-attr]
        want = ref_accum if case.name == "ddp_accum" else reference
        assert sorted(losses) == list(range(1, 11)), case.name
        assert losses[10] < losses[1] - 0.5, f"{case.name}: loss did not fall {losses}"
        norms = results[case.name]["grad_norms"]
        clip = case.recipe.optim.grad_clip
        assert min(norms) > clip, f"{case.name}: clipping was not active on every step {norms}"  # type: ignore[call-overload]
        for step, value in losses.items():
            assert value == pytest.approx(want[step], abs=LOSS_ATOL), (case.name, step)
