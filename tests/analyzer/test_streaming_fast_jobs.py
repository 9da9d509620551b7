"""Fast jobs: the streaming analyzer waits for every rank's batch of a step before analysing it.

A job of 20 ms steps whose ranks flush every second ships ~50 steps a batch, and its ranks'
flushes are not aligned. The analyzer analyses a step at the latest when a batch brings a step
half its window ahead; with the default 64 steps that came before the other ranks' batches
holding it, so such steps were scored without those ranks and the ranks' late records were
dropped (a straggler's own steps among them). The window now grows to hold four batches' worth
of steps (`jobstream.BATCHES_HELD`), within its limits.
"""

from __future__ import annotations

import numpy as np
import pytest

from vigil import columns, schema
from vigil.analyzer import engine, jobstream, streaming, window

RANKS, STEPS, FLUSH = 4, 400, 50  # steps per batch
SLOW, FROM = 2, 100  # rank 2 computes 1.25x from step 100


def _job() -> tuple[list[schema.Record], list[list[schema.Record]]]:
    """The job's records, and the batches in the order they arrive: rank r flushes its last
    50 steps whenever it finishes a step s with s % 50 == 12 r (unaligned flushes)."""
    rng = np.random.default_rng(7)
    head: list[schema.Record] = [schema.Job(job_id="fast", name="fast", world_size=RANKS)]
    head += [
        schema.RankInfo(job_id="fast", rank=r, node="n0", world_size=RANKS) for r in range(RANKS)
    ]
    pending: list[list[schema.Record]] = [[] for _ in range(RANKS)]
    batches: list[list[schema.Record]] = [head]
    for step in range(STEPS):
        start = 1000.0 + 0.025 * step
        compute = 0.02 * rng.uniform(0.97, 1.03, RANKS)
        if step >= FROM:
            compute[SLOW] *= 1.25
        end = start + compute.max() + 0.002
        for rank in range(RANKS):
            pending[rank].append(
                schema.StepRecord(
                    job_id="fast",
                    rank=rank,
                    step=step,
                    start_s=start,
                    end_s=end,
                    backward_s=float(compute[rank]),
                    comm_wait_s=float(end - start - compute[rank]),
                    tokens=32,
                )
            )
            if step % FLUSH == (12 * rank) % FLUSH or step == STEPS - 1:
                batches.append(pending[rank])
                pending[rank] = []
    return [r for batch in batches for r in batch], batches


def _stream(batches: list[list[schema.Record]]) -> tuple[list[schema.Finding], list[int], int]:
    """Findings, how many ranks each analysed step had when it was analysed, and the window's
    final length."""
    analyzer = streaming.StreamingAnalyzer()
    seen: list[int] = []
    original = jobstream.JobStream._analyse

    def spy(self: jobstream.JobStream, step: int, *args: object) -> list[schema.Finding]:
        seen.append(int(self.window.reported[step % self.window.capacity]))
        return original(self, step, *args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jobstream.JobStream, "_analyse", spy)
        found = [f for batch in batches for f in analyzer.observe(batch)]
    return found, seen, analyzer._jobs["fast"].window.capacity


def test_a_fast_job_is_analysed_with_every_rank_and_named_as_offline() -> None:
    records, batches = _job()
    found, seen, capacity = _stream(batches)
    assert capacity == 256  # 4 x 50 steps, to the next power of two
    assert len(seen) == STEPS and set(seen) == {RANKS}  # every step, each with all 4 ranks
    # A finding re-sent under its id (an MFU drop's evidence folded in) is one finding.
    latest = {f.finding_id: f for f in found if f.state is schema.FindingState.OPEN}
    online = [(f.kind, f.subjects.ranks) for f in latest.values()]
    offline = [(f.kind, f.subjects.ranks) for f in engine.analyze_records(records)]
    assert online == offline == [(schema.FindingKind.STRAGGLER, [SLOW])]


def test_a_window_that_cannot_grow_analyses_steps_without_every_rank() -> None:
    # What the fix changes: held to 64 steps (a job of 10,000 ranks' limit), steps are
    # analysed before every rank's batch holding them came.
    _, batches = _job()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jobstream, "MAX_WINDOW_STEPS", 64)
        _, seen, capacity = _stream(batches)
    assert capacity == 64
    assert min(seen) < RANKS


def test_a_lengthened_window_keeps_every_step_it_held() -> None:
    records, _ = _job()
    ring = window.StepWindow("fast", 64)
    steps = [r for r in records if isinstance(r, schema.StepRecord) and r.step < 100]
    ring.add_steps(columns.from_records(steps), 0)
    held = list(range(36, 100))  # the ring's 64 rows hold the newest 64 steps
    before = ring.view(held)
    ring.lengthen(256)
    after = ring.view(held)
    assert ring.capacity == 256
    for name in ("step_time_s", "comm_wait_s", "tokens", "step_start_s", "step_end_s"):
        np.testing.assert_array_equal(getattr(after, name), getattr(before, name))
    assert sorted(ring.row_step[ring.row_step >= 0].tolist()) == held
