"""A straggler holds its peers up: they wait for it, it waits least. A rank whose compute or CPU
wait only looks high, while it waits at the step's collectives as long as its peers or longer,
or whose CPU wait does not make it late, is no straggler; the rank that does hold the job is.

Four ranks, 40 steps of a synchronous job: every rank's step is the slowest rank's (150 ms from
step 10, 100 ms before); a rank's communication wait is what its own work leaves of that step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from vigil import schema
from vigil.analyzer import engine, streaming

RANKS, STEPS = 4, 40
Analyze = Callable[[list[schema.Record]], list[schema.Finding]]


def _job(work: Callable[[int, int], tuple[float, float]], step_s: float) -> list[schema.Record]:
    """`work(rank, step)` is (compute, CPU wait) in seconds; each step lasts the slowest rank's
    work or `step_s`, and every rank waits out the rest at its collectives."""
    rng = random.Random(5)
    out: list[schema.Record] = []
    for step in range(STEPS):
        noisy = {r: work(r, step) for r in range(RANKS)}
        noisy = {r: (c * (1 + rng.uniform(-0.02, 0.02)), w) for r, (c, w) in noisy.items()}
        seconds = max(step_s, *(c + w for c, w in noisy.values())) + 0.002
        start = 1000.0 + step * 0.3
        for rank, (compute, cpu_wait) in noisy.items():
            out.append(
                schema.StepRecord(
                    job_id="j", rank=rank, step=step, start_s=start, end_s=start + seconds,
                    comm_wait_s=seconds - compute - cpu_wait, cpu_wait_s=cpu_wait,
                )
            )  # fmt: skip
    return out


def _streamed(records: list[schema.Record]) -> list[schema.Finding]:
    analyzer = streaming.StreamingAnalyzer()
    found: list[schema.Finding] = []
    for step in range(STEPS):
        found += analyzer.observe([r for r in records if getattr(r, "step", -1) == step])
    return found


def _stragglers(found: list[schema.Finding]) -> list[list[int]]:
    return [f.subjects.ranks for f in found if f.kind == schema.FindingKind.STRAGGLER]


ANALYZERS = pytest.mark.parametrize(
    "analyze", [engine.analyze_records, _streamed], ids=["offline", "online"]
)


@ANALYZERS
def test_a_rank_waiting_for_a_cpu_while_a_slow_peer_holds_the_job_is_not_named(
    analyze: Analyze,
) -> None:
    """Rank 3 computes 50 % longer from step 10; rank 1 then also waits for a CPU 40 ms a step,
    which costs it nothing (it still ends its work before rank 3): only rank 3 is named."""

    def work(rank: int, step: int) -> tuple[float, float]:
        if step < 10:
            return 0.1, 0.001
        if rank == 3:
            return 0.15, 0.001
        if rank == 1:
            return 0.1, 0.04
        return 0.1, 0.001

    assert _stragglers(analyze(_job(work, step_s=0.1))) == [[3]]


@ANALYZERS
def test_compute_that_only_looks_high_while_the_rank_waits_longer_is_not_named(
    analyze: Analyze,
) -> None:
    """From step 10 rank 2's step reads 40 ms longer and its wait at the collectives 10 ms longer
    than its peers' (so its compute reads 30 % up), yet its peers wait no longer for it: it holds
    nobody up (the time is its measurement's, as when a step's end is taken late), and nothing is
    named."""
    records: list[schema.Record] = []
    for r in _job(lambda rank, step: (0.1, 0.001), step_s=0.1):
        assert isinstance(r, schema.StepRecord)
        if r.rank == 2 and r.step >= 10:
            fields = {f: getattr(r, f) for f in r.__struct_fields__}
            r = schema.StepRecord(
                **{**fields, "end_s": r.end_s + 0.04, "comm_wait_s": r.comm_wait_s + 0.01}
            )
        records.append(r)
    assert _stragglers(analyze(records)) == []


@ANALYZERS
def test_the_rank_that_holds_its_peers_up_is_named(analyze: Analyze) -> None:
    """Rank 2 computes 30 % longer from step 10 and its peers wait for it: it is the straggler."""

    def work(rank: int, step: int) -> tuple[float, float]:
        return (0.13 if rank == 2 and step >= 10 else 0.1), 0.001

    assert _stragglers(analyze(_job(work, step_s=0.1))) == [[2]]
