"""MFU drops: change points on noisy series, and attribution to their cause."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import simulator as sim
from vigil import flops, schema
from vigil.analyzer import arrays, config, engine, mfu, streaming


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
    # The levels the series was built with: 0.45 (lognormal median), then 0.8 x 0.45 = 0.36.
    assert drop.before == pytest.approx(0.45, rel=0.01)
    assert drop.after == pytest.approx(0.36, rel=0.01)


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


# A job whose SDK sent model FLOPs but no MFU (no peak known on the ranks); the Job record
# declares the peak, so the analyzer derives MFU. Every figure below is worked out by hand:
SHAPE = schema.ModelShape(params=1_000_000, layers=4, hidden=256, heads=4, seq_len=512)
# 6 N + 12 L hidden T = 6,000,000 + 12 x 4 x 256 x 512 = 6,000,000 + 6,291,456
FLOPS_PER_TOKEN = 12_291_456
TOKENS = 4 * 512  # four sequences per rank and step
MODEL_FLOPS = 25_172_901_888  # 12,291,456 x 2,048 per rank and step
PEAK = 2e11  # FLOP/s per device
STEP_S, SLOW_STEP_S = 0.25, 0.3125  # from step 60 every step takes 25 % longer
MFU_BEFORE = 0.50345803776  # 25,172,901,888 / 0.25 s / 2e11
MFU_AFTER = 0.402766430208  # 25,172,901,888 / 0.3125 s / 2e11 (= 0.8 x MFU_BEFORE)


def _job_without_sdk_mfu(num_ranks: int = 4, num_steps: int = 100) -> list[schema.Record]:
    job = schema.Job(job_id="flops", world_size=num_ranks, model=SHAPE, peak_flops=PEAK)
    records: list[schema.Record] = [job]
    start = 1_800_000_000.0
    for step in range(num_steps):
        seconds = STEP_S if step < 60 else SLOW_STEP_S
        records += [
            schema.StepRecord(
                job_id="flops",
                rank=rank,
                step=step,
                start_s=start,
                end_s=start + seconds,
                forward_s=seconds / 3,
                backward_s=seconds / 2,
                tokens=TOKENS,
                model_flops=MODEL_FLOPS,
            )
            for rank in range(num_ranks)
        ]
        start += seconds
    return records


def test_hand_computed_flops_of_a_small_model() -> None:
    assert flops.flops_per_token(SHAPE) == FLOPS_PER_TOKEN
    assert flops.flops_per_token(SHAPE) * TOKENS == MODEL_FLOPS


def test_mfu_from_model_flops_step_time_and_peak_matches_the_hand_computed_figure() -> None:
    a = arrays.from_records(_job_without_sdk_mfu(), job_id="flops")
    job_mfu = a.job_mfu()
    assert job_mfu[:60] == pytest.approx(np.full(60, MFU_BEFORE), rel=1e-6)
    assert job_mfu[60:] == pytest.approx(np.full(40, MFU_AFTER), rel=1e-6)


def _drop_levels(found: list[schema.Finding]) -> tuple[int, float, float | None]:
    [drop] = [f for f in found if f.kind == schema.FindingKind.MFU_DROP]
    level = drop.evidence[0]
    assert level.metric == "mfu" and "dropped 20.0%" in drop.summary, drop.summary
    return drop.step_start, level.observed, level.baseline


@pytest.mark.parametrize("mode", ["offline", "streaming"])
def test_mfu_drop_reports_the_hand_computed_levels(mode: str) -> None:
    records = _job_without_sdk_mfu()
    if mode == "offline":
        found = engine.analyze_records(records)
    else:
        analyzer = streaming.StreamingAnalyzer()
        found = [f for r in records for f in analyzer.observe([r])]
    step, observed, baseline = _drop_levels(found)
    assert step == 60
    # Evidence carries six significant digits.
    assert observed == pytest.approx(MFU_AFTER, rel=1e-5)
    assert baseline == pytest.approx(MFU_BEFORE, rel=1e-5)
