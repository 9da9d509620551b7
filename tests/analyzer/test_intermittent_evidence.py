"""A rank slow only every few steps carries its evidence in the period of its slow steps.

The accumulated excess clips each step's deviation at `evidence_clip` (so one hiccup adds
little), which caps an intermittent straggler's slow steps while its other steps, at its peers'
level, give back as much. data/jsonl_shapes/ddp-intermittent-capped is a real 4-rank DDP job
of `bench/faults.py` (`tests/realjobs/train.py`, the SDK's own JSONL) whose rank 3 is 2x slow
every 4th step from step 8: its flags were persistent from step 12, but its accumulated excess
peaked at 9.2 of the 12 needed, and the matrix missed it offline and online. Six of its last
48 steps at the clip, on one phase of a 4-step period, now carry the evidence.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.analyzer import recorded
from vigil.analyzer import arrays, config, excess, stragglers

JOB = recorded.DATA / "jsonl_shapes" / "ddp-intermittent-capped"
SLOW_RANK = 3


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_periodic_straggler_is_named_by_its_period(mode: str) -> None:
    records = recorded.records(JOB)
    (found,) = recorded.analyse(mode, records)
    assert recorded.named([found]) == [("straggler", [SLOW_RANK])]
    periodic = next(e for e in found.evidence if e.metric == "periodic_excursions")
    assert periodic.observed >= 6 and "every 4th step" in periodic.note
    assert "every 4th step" in found.summary
    assert found.step_start <= 8 + 20  # within 20 steps of the fault's onset
    # With a bar this job cannot reach (48 excursions in its 40 steps), the accumulated
    # excess alone misses it, as before:
    cfg = config.AnalyzerConfig()
    off = dataclasses.replace(cfg.straggler, periodic_excursions=cfg.straggler.evidence_steps)
    assert recorded.analyse(mode, records, dataclasses.replace(cfg, straggler=off)) == []


def test_the_accumulated_excess_alone_stays_under_its_threshold() -> None:
    a = arrays.from_records(recorded.records(JOB))
    cfg = config.StragglerConfig()
    col = list(a.ranks).index(SLOW_RANK)
    x = excess.scores(a, stragglers.stage_groups(a.stages), cfg)
    assert float(np.nanmax(excess.accumulate(x, cfg)[:, col])) < cfg.evidence_threshold


def test_excursions_at_no_period_are_no_evidence() -> None:
    """Seven excursions at irregular steps (a host's random hiccups) do not pass."""
    cfg = config.StragglerConfig()
    steps = np.arange(48, dtype=np.int64)
    x = np.zeros(48)
    x[[3, 5, 12, 20, 21, 33, 40]] = 9.0
    assert excess._periodic(steps, x, 0, 47, cfg) is None
    x[:] = 0.0
    x[[3, 7, 11, 15, 19, 23]] = 9.0  # every 4th step, six times: evident at the sixth
    row, evidence = excess._periodic(steps, x, 0, 47, cfg) or (None, None)
    assert row == 23 and evidence is not None and evidence.observed == 6


def test_the_period_answers_first_when_it_comes_before_the_sum() -> None:
    """Capped at the clip, slow steps every 4th step add 3.5 each and the steps between, a
    little under the peers' median, give back 0.8 each: the period is evident at the sixth
    slow step, the sum (threshold 12) much later."""
    cfg = config.StragglerConfig()
    steps = np.arange(48, dtype=np.int64)
    x = np.full((48, 1), -0.3)
    x[3::4] = 9.0
    col = excess.accumulate(x, cfg)[:, 0]
    sum_row = int(np.flatnonzero(col > cfg.evidence_threshold)[0])
    row, evidence = excess.evident(steps, x[:, 0], col, 0, 47, cfg) or (None, None)
    assert row == 23 < sum_row and evidence is not None
    assert evidence.metric == "periodic_excursions"


def test_periodic_excursions_is_validated() -> None:
    with pytest.raises(ValueError, match="periodic_excursions"):
        config.StragglerConfig(periodic_excursions=2)
    with pytest.raises(ValueError, match="periodic_excursions"):
        config.StragglerConfig(periodic_excursions=49)
