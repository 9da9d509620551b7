"""Small jobs: a 4-rank group's robust scale pooled over its last steps, on recorded real jobs.

The fixtures are the SDK's own JSONL of a real 4-rank gloo job (`tests/realjobs/train.py`,
wrapper `pp`: a 1F1B pipeline of four 256-wide stages, one per rank, on 2 shared cores),
in data/jsonl_pipeline/:

- slow-stage/: from step 8 rank 2's backward sleeps 25 % of a step (a slow layer). Its
  compute is ~17 ms against its peers' ~8 ms in nearly every step, but one step's MAD over
  four ranks is decided by two of their deviations: scored step by step its z stayed ~3,
  flagged in 12 scattered steps, never 8 of 12, and it was not reported.
- clean-jitter/: no fault; every rank sleeps 0-30 % of a step before each forward pass. On
  some steps three ranks' computes nearly coincided, their MAD was tiny, and rank 3 (the last
  stage, whose sleep replaces part of its bubble) scored z > 4 in 11 steps and was reported.
- slow-forward/: from step 8 rank 1's forward sleeps 25 % of a step (a CI run on a loaded
  host). Its compute is ~17 ms against ~9 ms and its wait ~16 ms against ~27 ms in nearly
  every step, but its peers' computes spread widely (one's CPU wait, taken out of its
  compute, swung by 10 ms): by compute alone it scored z ~4 and became persistent only
  from step 37, 29 steps after the onset.

Pooled over 12 steps (48 deviations), the scale is stable: the slow stage scores z ~5 and the
clean ranks stay under 3. A rank whose compute is high at z 3 while its wait is as low (both
halves of a straggler's signature) is flagged too (`StragglerConfig.corroborated_z`).

Where the ranks of a small group do the same work, compute high at z 3.5 alone counts
(`StragglerConfig.small_group_z`). data/jsonl_small_group/ddp-slow1.1-backward/ is a real 4-rank
DDP job of `bench/faults.py` (2 shared cores, steps of 30-100 ms): from step 8 rank 3's
backward sleeps a tenth of a step. It scored z 3-4 for 12 straight steps, flagged at z 4 in 5 of
them, and was not reported.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.analyzer import recorded
from tests.analyzer.recorded import analyse, named
from vigil import schema
from vigil.analyzer import arrays, config, robust, stragglers

DATA = recorded.DATA / "jsonl_pipeline"
# Reported only once flagged in `min_hits` of the window's steps (before `strong_hits`).
FULL_HITS = config.StragglerConfig().min_hits
# As scored before: each step's own MAD, compute alone, no accumulated-excess test.
PER_STEP = config.AnalyzerConfig(
    straggler=config.StragglerConfig(
        scale_samples=1,
        corroborated_z=4.0,
        small_group_z=4.0,
        evidence_threshold=0.0,
        strong_hits=FULL_HITS,
    )
)
# ... and without its forward pass compared with its own earlier steps (forward_shift.py).
COMPUTE_ALONE = config.AnalyzerConfig(
    straggler=config.StragglerConfig(
        corroborated_z=4.0, small_group_z=4.0, min_shift=9.0, strong_hits=FULL_HITS
    )
)
# Compute outliers of small groups at z 4 alone (before `small_group_z`).
AT_Z4 = config.AnalyzerConfig(straggler=config.StragglerConfig(small_group_z=4.0))


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_pipeline_stage_a_quarter_slower_is_named(mode: str) -> None:
    records = recorded.records(DATA / "slow-stage")
    assert named(analyse(mode, records)) == [("straggler", [2])]
    # Scored by each step's own MAD (before), the same job was not reported.
    assert named(analyse(mode, records, PER_STEP)) == []


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_clean_jittery_pipeline_has_no_finding(mode: str) -> None:
    records = recorded.records(DATA / "clean-jitter")
    assert named(analyse(mode, records)) == []
    assert named(analyse(mode, records, PER_STEP)) == [("straggler", [3])]


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_stage_that_computes_more_and_waits_least_is_named_soon(mode: str) -> None:
    records = recorded.records(DATA / "slow-forward")
    (found,) = analyse(mode, records)
    assert (found.kind, found.subjects.ranks) == (schema.FindingKind.STRAGGLER, [1])
    assert found.step_start <= 8 + 20  # within 20 steps of the onset
    # By its compute alone, the same stage was reported 29 steps after the onset.
    (late,) = analyse(mode, records, COMPUTE_ALONE)
    assert late.subjects.ranks == [1] and late.step_start > 8 + 20


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_ddp_rank_a_tenth_slower_in_backward_is_named_at_the_small_group_bar(mode: str) -> None:
    records = recorded.records(recorded.DATA / "jsonl_small_group" / "ddp-slow1.1-backward")
    (found,) = analyse(mode, records)
    assert (found.kind, found.subjects.ranks) == (schema.FindingKind.STRAGGLER, [3])
    assert 8 <= found.step_start <= 8 + 20  # within 20 steps of the onset
    # At z 4 alone, as before, the same job was not reported.
    assert analyse(mode, records, AT_Z4) == []


def test_pipeline_stages_scored_together_keep_the_full_bar() -> None:
    # Rank 3 of the clean jittery pipeline: stages do different work, so z 3.5 does not flag
    # them (at 3.5 its scattered flags became persistent, 8 of 12 steps).
    a = arrays.from_records(recorded.records(DATA / "clean-jitter"))
    cfg = config.StragglerConfig()
    at_default = stragglers.score(a, cfg).compute
    at_z4 = stragglers.score(a, dataclasses.replace(cfg, small_group_z=4.0)).compute
    np.testing.assert_array_equal(at_default, at_z4)


def test_the_scale_pools_enough_steps_for_its_samples_and_no_more() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(10.0, 1.0, (30, 4))
    center, scale = robust.robust_center_scale(
        values, scale_floor=0.001, min_samples=16, max_rows=12
    )
    deviations = np.abs(values - np.median(values, axis=1, keepdims=True))
    # 16 samples over 4 columns: each row pools itself and the 3 rows before it.
    for row in (0, 2, 3, 29):
        pooled = deviations[max(0, row - 3) : row + 1]
        assert scale[row, 0] == pytest.approx(robust.MAD_TO_SIGMA * np.median(pooled))
    # Capped at `max_rows`; with as many columns as samples, each row is scored alone.
    _, capped = robust.robust_center_scale(values, scale_floor=0.001, min_samples=400, max_rows=5)
    assert capped[29, 0] == pytest.approx(robust.MAD_TO_SIGMA * np.median(deviations[25:30]))
    _, alone = robust.robust_center_scale(values, scale_floor=0.001, min_samples=4, max_rows=12)
    assert alone[:, 0] == pytest.approx(robust.MAD_TO_SIGMA * np.median(deviations, axis=1))
    assert center[:, 0] == pytest.approx(np.median(values, axis=1))
