"""MFU accounting: the PaLM formula, the device table, torch's flop counter, a CPU peak."""

from __future__ import annotations

import pytest
import torch

from vigil import flops, schema
from vigil.agent import mfu
from vigil.trainer import recipes


def test_palm_formula_counts_parameters_and_attention() -> None:
    shape = schema.ModelShape(params=124_000_000, layers=12, hidden=768, heads=12, seq_len=1024)
    assert mfu.palm_flops_per_token(shape) == 6 * 124e6 + 12 * 12 * 768 * 1024
    with pytest.raises(ValueError, match="params > 0"):
        mfu.palm_flops_per_token(schema.ModelShape(params=0))


def test_tiny_recipe_flops_by_hand() -> None:
    model = recipes.named("tiny").model  # vocab 256, dim 64, 2 layers, 4 heads, SwiGLU 192
    block = (64 * 64 * 2 + 64 * 64 * 2) + 3 * 64 * 192 + 2 * 64  # attention, MLP, two norms
    n = 2 * block + 64 + 256 * 64  # blocks, final norm, output head; no input embedding table
    assert n == 123_200
    assert model.shape(32).params == n == model.num_params() - 256 * 64
    assert model.flops_per_token(32) == 6 * n + 12 * 2 * 64 * 32 == 788_352


@pytest.mark.parametrize("name", recipes.recipe_names())
def test_trainer_recipe_and_sdk_agree_on_flops_per_token(name: str) -> None:
    recipe = recipes.named(name)
    shape = recipe.model.shape(recipe.seq_len)  # what the trainer hands the SDK
    want = recipe.model.flops_per_token(recipe.seq_len)  # what the trainer's own MFU uses
    assert mfu.palm_flops_per_token(shape) == want == flops.flops_per_token(shape)
    # N leaves out the input embedding table only: the output head is a matmul per token.
    embed = recipe.model.vocab_size * recipe.model.dim
    assert shape.params == recipe.model.num_params() - embed


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H200", 989e12),
        ("AMD Instinct MI300X", 1307e12),
        ("NVIDIA B200", 2250e12),
        ("Some Future GPU", None),
    ],
)
def test_device_peak_table(name: str, peak: float | None) -> None:
    assert mfu.peak_for_device(name) == peak


def test_flop_counter_matches_a_linear_layer() -> None:
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    flops = mfu.count_flops(lambda: layer(x).sum().backward())
    assert flops == 3 * 2 * 8 * 64 * 32  # forward GEMM + grad-input and grad-weight GEMMs


def test_mfu_and_measured_cpu_peak() -> None:
    peak = mfu.measure_cpu_peak(size=128, budget_s=0.1)
    assert peak > 1e6  # a plausible positive rate even on a heavily shared CPU
    assert mfu.mfu(flops_per_token=1e9, tokens=1000, seconds=2.0, peak_flops=1e12) == 0.5
    assert mfu.mfu(flops_per_token=1e9, tokens=0, seconds=2.0, peak_flops=1e12) == 0.0
