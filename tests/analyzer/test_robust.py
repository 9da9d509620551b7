"""The streaming shortcuts of analyzer/robust.py agree with the general forms they replace."""

from __future__ import annotations

import numpy as np
import pytest

from vigil.analyzer import robust


@pytest.mark.parametrize("seed", range(20))
def test_trimmed_mean_last_is_the_rolling_mean_last_row(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, ranks = int(rng.integers(1, 12)), int(rng.integers(1, 40))
    values = rng.gamma(2.0, 0.5, size=(rows, ranks)).astype(np.float32)
    values[rng.random(values.shape) < 0.2] = np.nan  # missing reports, some whole columns
    for steps in (1, 2, 4, 16):
        expected = robust.rolling_trimmed_mean(values, steps)[-1:]
        got = robust.trimmed_mean_last(values, steps)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        np.testing.assert_allclose(got, expected, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("axis", [0, 1])
def test_nanmedian_matches_numpy_with_and_without_missing(axis: int) -> None:
    rng = np.random.default_rng(3)
    values = rng.normal(size=(7, 9))
    np.testing.assert_array_equal(robust.nanmedian(values, axis), np.nanmedian(values, axis=axis))
    values[rng.random(values.shape) < 0.3] = np.nan
    with np.errstate(all="ignore"):
        expected = np.nanmedian(values, axis=axis, keepdims=True)
    got = robust.nanmedian(values, axis, keepdims=True)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed", range(30))
def test_newest_window_drop_test_matches_the_full_series_test(seed: int) -> None:
    from vigil.analyzer import config, mfu

    cfg = config.MfuConfig()
    rng = np.random.default_rng(seed)
    n = cfg.baseline_steps + cfg.recent_steps + int(rng.integers(0, 10))
    series = 0.4 + rng.normal(0, 0.002, n)
    series[n - int(rng.integers(1, cfg.recent_steps + 3)) :] *= rng.choice([0.7, 0.97, 1.0])
    if seed % 3 == 0:
        series[rng.integers(0, n)] = np.nan  # a step without MFU
    flags = mfu.drop_flags(series, cfg)[0]
    assert mfu.newest_is_drop(series, cfg) == bool(flags[-1])
    assert not mfu.newest_is_drop(series[: cfg.baseline_steps], cfg)
