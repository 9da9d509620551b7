"""bench/sdk_overhead.py's in-place CPU intervals resample whole sets of models, not cycles: a
set's models keep their own cost for as long as they live, so the cycles of one set are not
independent draws, and an interval over cycles would read far narrower than the figure's
spread from one set of models to the next (bench/overhead_report.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("overhead_report", BENCH / "overhead_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sets_with_offsets(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """48 sets of 25 cycles: each set's cost offset by its own draw (sd 300 us), each cycle's by
    noise (sd 100 us) around a true 250 us."""
    rng = np.random.default_rng(seed)
    sets = np.repeat(np.arange(48), 25)
    offsets = rng.normal(0.0, 300e-6, 48)
    seconds = 250e-6 + offsets[sets] + rng.normal(0.0, 100e-6, sets.size)
    return seconds, sets


def test_a_draw_takes_whole_sets() -> None:
    report = _report()
    sets = np.repeat(np.arange(4), 3)
    for pick in report._set_draws(sets, 50):
        assert pick.size == sets.size
        drawn, counts = np.unique(sets[pick], return_counts=True)
        assert all(count % 3 == 0 for count in counts.tolist())  # a set's 3 cycles together
        assert set(drawn.tolist()) <= {0, 1, 2, 3}


def test_the_interval_is_as_wide_as_the_spread_between_sets() -> None:
    report = _report()
    seconds, sets = _sets_with_offsets()
    median, (low, high) = report._median_interval(seconds, report._set_draws(sets))
    cycles = report._set_draws(np.arange(sets.size))
    _, (cycle_low, cycle_high) = report._median_interval(seconds, cycles)
    # The set effects' standard error over 48 sets: ~300 / sqrt(48) = ~43 us; a 90 % interval
    # spans ~3.3 of it. Cycles resampled alone see ~100-300 us / sqrt(1,200): far narrower.
    assert high - low > 80.0
    assert (high - low) > 2 * (cycle_high - cycle_low)
    assert low < median < high


def test_the_share_interval_resamples_the_same_sets_for_both_medians() -> None:
    report = _report()
    sdk, sets = _sets_with_offsets(1)
    profiler = 2500e-6 + sdk * 0.0  # a profiler cost without set effects
    low, high = report._share_interval(sdk, profiler, report._set_draws(sets))
    share = float(np.median(sdk) / np.median(profiler))
    assert low < share < high
    assert high - low > 0.03  # the sets' spread (~0.12 / 2.5 ms over 48 sets), not the cycles'
