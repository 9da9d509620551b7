"""A rank's wait for a CPU is the host's time, not its work: the analyzer leaves it out of
compute, offline and streaming, and shows it as evidence when the rank is a straggler anyway.

Four ranks, 40 steps of 100 ms with ±3 % noise; rank 2 is longer from step 10. 8 ms longer,
all of it waiting for a CPU (`cpu_wait_s`): no finding names it (its compute is its peers', and
its wait is below `min_cpu_wait_share` of the step); told nothing, it is a compute straggler.
30 ms longer of which a fifth is CPU wait: a compute straggler with its wait as evidence. A rank
waiting for a CPU 40 % of its step is a straggler whose cause is its host.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from vigil import schema
from vigil.analyzer import engine, streaming

RANKS, STEPS, STEP_S, EXTRA_S = 4, 40, 0.1, 0.03
Analyze = Callable[[list[schema.Record]], list[schema.Finding]]


def _records(cpu_wait_of_extra: float, extra_s: float = EXTRA_S) -> list[schema.Record]:
    rng = random.Random(7)
    out: list[schema.Record] = []
    for step in range(STEPS):
        for rank in range(RANKS):
            extra = extra_s if rank == 2 and step >= 10 else 0.0
            seconds = STEP_S * (1 + rng.uniform(-0.03, 0.03)) + extra
            start = 1000.0 + step * 0.2
            out.append(
                schema.StepRecord(
                    job_id="j",
                    rank=rank,
                    step=step,
                    start_s=start,
                    end_s=start + seconds,
                    cpu_wait_s=0.002 + extra * cpu_wait_of_extra,
                )
            )
    return out


def _stragglers(found: list[schema.Finding]) -> list[list[int]]:
    return [f.subjects.ranks for f in found if f.kind == schema.FindingKind.STRAGGLER]


def _streamed(records: list[schema.Record]) -> list[schema.Finding]:
    analyzer = streaming.StreamingAnalyzer()
    found: list[schema.Finding] = []
    steps = 1 + max(getattr(r, "step", 0) for r in records)
    for step in range(steps):  # a step's records as a collector receives them
        found += analyzer.observe([r for r in records if getattr(r, "step", -1) == step])
    return found


@pytest.mark.parametrize("analyze", [engine.analyze_records, _streamed], ids=["offline", "online"])
def test_time_waiting_for_a_cpu_does_not_make_a_straggler(analyze: Analyze) -> None:
    assert analyze(_records(cpu_wait_of_extra=1.0, extra_s=0.008)) == []


@pytest.mark.parametrize("analyze", [engine.analyze_records, _streamed], ids=["offline", "online"])
def test_a_rank_slow_beyond_its_cpu_wait_is_a_straggler_with_that_wait_as_evidence(
    analyze: Analyze,
) -> None:
    found = analyze(_records(cpu_wait_of_extra=0.2))
    assert _stragglers(found) == [[2]]
    (straggler,) = [f for f in found if f.kind == schema.FindingKind.STRAGGLER]
    cpu = {e.metric: e for e in straggler.evidence}["cpu_wait_time"]
    assert cpu.observed == pytest.approx(0.002 + EXTRA_S * 0.2, rel=1e-3)
    assert cpu.baseline == pytest.approx(0.002, rel=1e-3)
    compute = straggler.evidence[0]
    assert compute.metric == "compute_time"
    assert compute.observed == pytest.approx(STEP_S + EXTRA_S - (0.002 + EXTRA_S * 0.2), abs=0.004)


def test_records_without_cpu_wait_are_judged_as_before() -> None:
    records = [
        schema.StepRecord(**{**_plain(r), "cpu_wait_s": 0.0}) for r in _records(1.0, 0.008)
    ]  # an older SDK: the field is absent, so 0
    assert _stragglers(engine.analyze_records(records)) == [[2]]


def _plain(record: schema.Record) -> dict[str, object]:
    assert isinstance(record, schema.StepRecord)
    return {f: getattr(record, f) for f in record.__struct_fields__}


def _starved_records(
    until: int | None = None, *, steps: int = STEPS, step_s: float = STEP_S
) -> list[schema.Record]:
    """Rank 1 waits for a CPU 40 % of its step from step 10 to `until` (None: the last; a
    process in its session takes its CPU time); its own compute is its peers'. Every rank also
    waits a little, unevenly. A step starts every 2 x `step_s`."""
    until = steps if until is None else until
    rng = random.Random(11)
    out: list[schema.Record] = []
    for step in range(steps):
        for rank in range(RANKS):
            wait = step_s * rng.uniform(0.02, 0.08)
            if rank == 1 and 10 <= step < until:
                wait += 0.4 * step_s
            seconds = step_s * (1 + rng.uniform(-0.03, 0.03)) + wait
            start = 1000.0 + step * 2 * step_s
            out.append(
                schema.StepRecord(
                    job_id="j", rank=rank, step=step, start_s=start, end_s=start + seconds,
                    cpu_wait_s=wait,
                )
            )  # fmt: skip
    return out


@pytest.mark.parametrize("analyze", [engine.analyze_records, _streamed], ids=["offline", "online"])
def test_a_rank_starved_of_cpu_is_a_straggler_whose_cause_is_its_host(analyze: Analyze) -> None:
    found = analyze(_starved_records())
    assert _stragglers(found) == [[1]]
    (straggler,) = found
    head = straggler.evidence[0]
    assert head.metric == "cpu_wait_time"
    assert head.observed > 4 * (head.baseline or 0.0)
    assert "waiting for a CPU" in straggler.summary


@pytest.mark.parametrize("analyze", [engine.analyze_records, _streamed], ids=["offline", "online"])
def test_a_starved_rank_is_reported_once_its_wait_has_lasted(analyze: Analyze) -> None:
    # Starved from step 10 (its smoothed wait flagged from step ~11, persistent by ~18): reported
    # once the episode has lasted min_cpu_wait_episode_s (3 s: 15 steps of 0.2 s), not before.
    lasting = streaming.config_mod.StragglerConfig().min_cpu_wait_episode_s
    (straggler,) = analyze(_starved_records())
    assert straggler.detected_s - (1000.0 + straggler.step_start * 0.2) >= lasting
    assert straggler.detected_s - (1000.0 + straggler.step_start * 0.2) < lasting + 0.5


@pytest.mark.parametrize("analyze", [engine.analyze_records, _streamed], ids=["offline", "online"])
def test_a_rank_starved_for_a_passing_while_is_not_reported(analyze: Analyze) -> None:
    # 13 steps (2.6 s of wall time) beside a busy process, then its share back: the scheduler's
    # passing imbalance when every core has a busy process, not a neighbour that stays.
    assert _stragglers(analyze(_starved_records(until=23))) == []
    assert _stragglers(analyze(_starved_records(until=30))) == [[1]]  # 4 s: reported


@pytest.mark.parametrize("analyze", [engine.analyze_records, _streamed], ids=["offline", "online"])
def test_a_starved_rank_of_a_fast_job_is_reported_beyond_the_streaming_window(
    analyze: Analyze,
) -> None:
    # 10 ms steps every 20 ms: the streaming window (64 steps) spans 1.3 s, less than the 3 s a
    # starved rank's episode must last; the episode's start is kept beyond it. 1 s of it is not.
    window = streaming.config_mod.AnalyzerConfig().stream_window_steps
    assert window * 0.02 < streaming.config_mod.StragglerConfig().min_cpu_wait_episode_s
    (straggler,) = analyze(_starved_records(steps=300, step_s=0.01))
    assert straggler.subjects.ranks == [1]
    assert 3.0 <= straggler.detected_s - 1000.0 - 10 * 0.02 < 3.5
    assert _stragglers(analyze(_starved_records(until=60, steps=300, step_s=0.01))) == []
