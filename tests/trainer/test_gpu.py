"""GPU paths (bf16 under FSDP's mixed-precision policy or autocast, CUDA device placement).

Skipped without CUDA: this development host has none, so these have not run here; they run on a
GPU machine (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from vigil.trainer import loop, recipes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_tiny_recipe_trains_on_one_gpu_like_on_cpu() -> None:
    recipe = recipes.named("tiny", steps=8, precision=recipes.Precision.BF16)
    device = torch.device("cuda", 0)
    with loop.trainer_session(recipe, ctx=loop.RunContext(device=device)) as trainer:
        gpu = trainer.train().losses
    with loop.trainer_session(recipe, ctx=loop.RunContext()) as trainer:
        cpu = trainer.train().losses
    assert gpu[8] < gpu[1] - 0.5
    for step, value in cpu.items():
        assert gpu[step] == pytest.approx(value, abs=0.1), step
