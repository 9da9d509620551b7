"""The one FLOPs-per-token definition (vigil.flops) against hand-computed values."""

from __future__ import annotations

import pytest

from vigil import flops, schema


def test_palm_formula_on_a_small_shape_by_hand() -> None:
    shape = schema.ModelShape(params=1000, layers=2, hidden=8, heads=2, seq_len=4)
    # 6·N = 6000; attention 12·L·(H·Q)·T = 12·2·8·4 = 768
    assert flops.flops_per_token(shape) == 6768.0


def test_shape_without_attention_dimensions_counts_parameters_only() -> None:
    assert flops.flops_per_token(schema.ModelShape(params=1000)) == 6000.0


def test_shape_needs_parameters() -> None:
    with pytest.raises(ValueError, match="params > 0"):
        flops.flops_per_token(schema.ModelShape(params=0, layers=2, hidden=8, seq_len=4))
