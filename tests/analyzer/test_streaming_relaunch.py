"""A job relaunched from a checkpoint trains again steps the streaming analyzer has analysed:
its new attempt is analysed as it comes, not skipped until it passes the old attempt's newest
step; a retried shipment of old records is not a relaunch."""

from __future__ import annotations

import numpy as np
import pytest

from vigil import columns, schema
from vigil.analyzer import streaming, window

RANKS = 8


def _attempt(
    rng: np.random.Generator, t0: float, steps: range, slow: int = -1, slow_from: int = 10**9
) -> tuple[list[schema.StepRecord], float]:
    """Synchronous steps of a data-parallel job: each rank computes ~0.2 s (3 % jitter), `slow`
    1.5x from `slow_from` on, and waits for the last to arrive at the step's all-reduce."""
    out, t = [], t0
    for step in steps:
        compute = 0.2 * (1 + 0.03 * rng.standard_normal(RANKS))
        if step >= slow_from:
            compute[slow] *= 1.5
        arrive = t + 0.01 + compute
        end = float(arrive.max()) + 0.02
        out += [
            schema.StepRecord(
                job_id="j", rank=r, step=step, start_s=t, end_s=end, data_s=0.01,
                comm_wait_s=float(arrive.max() - arrive[r]) + 0.005,
            )
            for r in range(RANKS)
        ]  # fmt: skip
        t = end
    return out, t


def _stream(
    analyzer: streaming.StreamingAnalyzer, records: list[schema.StepRecord]
) -> list[schema.Finding]:
    found: list[schema.Finding] = []
    for i in range(0, len(records), 4 * RANKS):  # four steps a batch, every rank's
        found += analyzer.observe(records[i : i + 4 * RANKS])
    return found


@pytest.mark.parametrize("announced", [False, True])
def test_a_straggler_in_steps_trained_again_is_found_as_they_come(announced: bool) -> None:
    rng = np.random.default_rng(1)
    analyzer = streaming.StreamingAnalyzer()
    old, t = _attempt(rng, 1000.0, range(61))
    assert _stream(analyzer, old) == []
    if announced:  # vigil's controller posts its restart; torchrun's says nothing
        restart = schema.Action(
            action_id="r1", kind=schema.ActionKind.RESTART, job_id="j",
            state=schema.ActionState.RUNNING, start_s=t + 1.0,
        )  # fmt: skip
        analyzer.observe([restart])
    # Resumed from the checkpoint after step 39: rank 5 is 1.5x slow from step 45 on.
    new, _ = _attempt(rng, t + 8.0, range(40, 141), slow=5, slow_from=45)
    found = _stream(analyzer, new)
    assert [(f.kind, f.subjects.ranks) for f in found] == [(schema.FindingKind.STRAGGLER, [5])]
    # Found among the steps trained again (the old attempt reached step 60), within 20 steps.
    assert 45 <= found[0].step_start < 61
    ends = {r.step: r.end_s for r in new}
    assert found[0].detected_s <= ends[45 + 20], (found[0].detected_s, ends[65])


def test_the_old_attempts_straggler_finding_resolves_at_the_relaunch() -> None:
    rng = np.random.default_rng(2)
    analyzer = streaming.StreamingAnalyzer()
    old, t = _attempt(rng, 1000.0, range(61), slow=2, slow_from=20)
    found = _stream(analyzer, old)
    assert [(f.kind, f.subjects.ranks, f.state) for f in found] == [
        (schema.FindingKind.STRAGGLER, [2], schema.FindingState.OPEN)
    ]
    new, _ = _attempt(rng, t + 8.0, range(40, 80))  # the slow host was replaced
    after = _stream(analyzer, new)
    assert [(f.finding_id, f.state) for f in after] == [
        (found[0].finding_id, schema.FindingState.RESOLVED)
    ]


def test_a_retried_shipment_is_not_a_relaunch_and_a_resumed_step_is() -> None:
    rng = np.random.default_rng(3)
    ring = window.StepWindow("j", 64)
    old, t = _attempt(rng, 1000.0, range(30))
    ring.add_steps(columns.from_records(old), 0)
    retried = columns.from_records(old[-4 * RANKS :])  # steps 26-29 again, as first sent
    assert np.isnan(ring.relaunched_at(retried))
    new, _ = _attempt(rng, t + 5.0, range(20, 24))
    assert ring.relaunched_at(columns.from_records(new)) == pytest.approx(t + 5.0)
    # A new rank's first steps are not a relaunch, whatever their numbers.
    stranger = [schema.StepRecord(job_id="j", rank=RANKS, step=3, start_s=t + 1, end_s=t + 1.2)]
    assert np.isnan(ring.relaunched_at(columns.from_records(stranger)))
