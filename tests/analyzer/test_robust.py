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


@pytest.mark.parametrize("seed", range(10))
def test_others_median_leaves_each_column_out(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(6, int(rng.integers(2, 9))))
    values[rng.random(values.shape) < 0.2] = np.nan
    groups = rng.integers(0, 2, values.shape[1])
    got = robust.others_median(values, groups)
    for col in range(values.shape[1]):
        peers = [c for c in np.flatnonzero(groups == groups[col]) if c != col]
        expected = np.full(values.shape[0], np.nan)
        for row in range(values.shape[0]):
            seen = values[row, peers][np.isfinite(values[row, peers])]
            if seen.size:
                expected[row] = np.median(seen)
        np.testing.assert_allclose(got[:, col], expected, equal_nan=True)


def test_others_median_of_a_small_group_is_not_the_value_itself() -> None:
    # The median of 3 ranks is one of them; the others' median is the deviation's reference.
    got = robust.others_median(np.array([[1.0, 2.0, 10.0]]))
    np.testing.assert_array_equal(got, [[6.0, 5.5, 1.5]])


@pytest.mark.parametrize("leave_out_largest", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_accumulated_excess_is_the_best_recent_run(seed: int, leave_out_largest: bool) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(30, 3))
    x[rng.random(x.shape) < 0.1] = np.nan
    k, steps = 0.5, int(rng.integers(1, 12))
    got = robust.accumulated_excess(x, k, steps, leave_out_largest=leave_out_largest)
    terms = np.where(np.isfinite(x), x - k, 0.0)
    for t in range(x.shape[0]):
        runs = [terms[j : t + 1] for j in range(max(0, t - steps + 1), t + 1)]
        sums = [
            run.sum(axis=0) - (np.maximum(run.max(axis=0), 0.0) if leave_out_largest else 0.0)
            for run in runs
        ]
        np.testing.assert_allclose(got[t], np.max(sums, axis=0), atol=1e-12)


def test_a_one_off_spike_adds_nothing_once_the_largest_step_is_left_out() -> None:
    x = np.zeros((12, 1))
    x[3] = 4.0  # one hiccup, clipped
    assert robust.accumulated_excess(x, 0.5, 8)[3, 0] == pytest.approx(3.5)
    assert robust.accumulated_excess(x, 0.5, 8, leave_out_largest=True)[3, 0] == 0.0
    x[6] = 4.0  # a second one: one hiccup's worth, less the allowance of the steps between
    got = robust.accumulated_excess(x, 0.5, 8, leave_out_largest=True)[6, 0]
    assert got == pytest.approx(3.5 - 2 * 0.5)


def test_accumulated_excess_forgets_what_is_older_than_its_steps() -> None:
    x = np.zeros((20, 1))
    x[:5] = 3.0  # 5 steps 2.5 above the allowance, then nothing
    got = robust.accumulated_excess(x, 0.5, 8)[:, 0]
    assert got[4] == pytest.approx(12.5)
    assert got[7] == pytest.approx(12.5 - 3 * 0.5)  # the run from row 0, 8 rows long
    assert got[8] == pytest.approx(4 * 2.5 - 4 * 0.5)  # row 0 has left the last 8 rows
    assert got[19] == pytest.approx(-0.5)  # only the newest step: nothing accumulates
