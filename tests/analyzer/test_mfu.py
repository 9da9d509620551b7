"""MFU drops: change points on noisy series, and attribution to their cause."""

from __future__ import annotations

import numpy as np

from tests.support import simulator as sim
from vigil import schema
from vigil.analyzer import config, engine, mfu


def _drops(*faults: sim.Fault, ranks: int = 64) -> list[schema.Finding]:
    s = sim.simulate(sim.ScenarioConfig(num_ranks=ranks, num_steps=120, faults=faults, seed=9))
    return [f for f in engine.analyze_arrays(s.arrays) if f.kind == "mfu_drop"]


def test_change_point_ignores_isolated_slow_steps() -> None:
    rng = np.random.default_rng(0)
    series = 0.45 * rng.lognormal(0, 0.01, 200)
    series[50] = series[70] = 0.2  # two hiccups before the real change
    series[120:] *= 0.8
    [drop] = mfu.find_drops(series, config.MfuConfig())
    assert drop.change_row == 120
    assert drop.after / drop.before == np.float64(drop.after / drop.before)
    assert 0.75 < drop.after / drop.before < 0.85


def test_no_drop_on_steady_noise() -> None:
    rng = np.random.default_rng(1)
    assert mfu.find_drops(0.4 * rng.lognormal(0, 0.03, 5000), config.MfuConfig()) == []


def test_job_wide_data_stall_is_attributed_to_data_loading() -> None:
    [drop] = _drops(sim.Fault(kind=sim.FaultKind.DATA_STALL, extra_s=0.3, start_step=60))
    assert "data stall" in drop.summary and drop.step_start == 60
    data = next(e for e in drop.evidence if e.metric == "data_time")
    assert data.observed - data.baseline > 0.25


def test_slow_link_drop_is_attributed_to_communication() -> None:
    [drop] = _drops(
        sim.Fault(kind=sim.FaultKind.SLOW_LINK, nodes=(1, 2), factor=3.0, start_step=60)
    )
    assert "communication" in drop.summary


def test_throttling_everywhere_is_attributed_to_throttling() -> None:
    [drop] = _drops(sim.Fault(kind=sim.FaultKind.THROTTLE, factor=0.8, start_step=60), ranks=16)
    assert "GPU throttling" in drop.summary and len(drop.subjects.ranks) == 16
    level = drop.evidence[0]
    assert level.metric == "mfu" and level.observed < 0.85 * (level.baseline or 0)
