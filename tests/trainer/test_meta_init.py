"""Large recipes start without any rank holding the whole model: built on the meta device,
parallelised there, and only each rank's shard is allocated and initialised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer import workers
from vigil.trainer import model, recipes


def test_the_70b_recipe_is_built_without_allocating_it() -> None:
    cfg = recipes.named("70b").model
    skeleton = model.skeleton(cfg)
    params = list(skeleton.parameters())
    assert sum(p.numel() for p in params) == cfg.num_params()
    assert {p.device.type for p in params} == {"meta"}


def test_weights_depend_on_seed_and_name_only() -> None:
    cfg = recipes.named("tiny").model
    a = model.build(cfg, seed=3, device=torch.device("cpu"))
    b = model.build(cfg, seed=3, device=torch.device("cpu"))
    c = model.build(cfg, seed=4, device=torch.device("cpu"))
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(x, y), name
        if x.dim() == 2:
            assert not torch.equal(x, z), name
            assert 0.005 < x.std().item() < 0.03, name
        else:
            assert torch.equal(x, torch.ones_like(x)), name  # norms start at 1
    assert model.canonical_name("layers.0._checkpoint_wrapped_module._orig_mod.w1.weight") == (
        "layers.0.w1.weight"
    )


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_an_fsdp_rank_allocates_its_shard_not_the_whole_model(tmp_path: Path) -> None:
    cfg = recipes.ModelConfig(vocab_size=8192, dim=1024, n_layers=16, n_heads=16, max_seq_len=64)
    recipe = workers.with_parallel(recipes.named("tiny").replace(model=cfg), dp=4)
    full_bytes = cfg.num_params() * 4  # fp32 master weights
    ranks = workers.assemble_only(4, recipe, tmp_path)
    for rank in ranks:
        assert rank["devices"] == ["cpu"]
        held = rank["held_bytes"]
        assert isinstance(held, int) and abs(held - full_bytes / 4) < 0.02 * full_bytes
        # Materialising the whole model first would grow each rank by at least full_bytes; the
        # shard plus one whole parameter at a time (to draw it) stays far below.
        grown = rank["peak_growth_bytes"]
        assert isinstance(grown, int) and grown < 0.45 * full_bytes, (grown, full_bytes)
