"""The analyzer's scale, for `bench/detect.py` (which prints these figures after detection
quality, unless `--scale-rounds 0`): offline analysis of 10,000 ranks x 1,000 steps on one
core, the streaming analyzer's per-step update at 10,000 ranks (step records alone, and all a
step ships), and the same load shipped rank by rank through the collector's `AnalyzerRunner`
(queued batches merged) beside one `observe` call per batch. The jobs come from
`tests/support/simulator.py`, which only shapes the input here. CPU time of the analysing
thread, wall time beside it: this machine's cores are shared.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vigil import columns, schema
from vigil.analyzer import engine, streaming
from vigil.collector.analyzer_runner import AnalyzerRunner, merge

# The simulator is test support (tests/support/), not shipped: run from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import simulator as sim


def offline_scale(ranks: int, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each of `rounds` offline analyses of a clean job, on one core."""
    s = sim.simulate(sim.ScenarioConfig(job_id="scale", num_ranks=ranks, num_steps=steps, seed=5))
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cpus:
        os.sched_setaffinity(0, {min(cpus)})  # "on one core"
    wall, cpu = [], []
    try:
        for _ in range(rounds):
            start, cpu0 = time.perf_counter(), time.thread_time()
            engine.analyze_arrays(s.arrays)
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - cpu0)
        return wall, cpu
    finally:
        if cpus:
            os.sched_setaffinity(0, cpus)


def streaming_scale(ranks: int, steps: int, *, full: bool) -> tuple[list[float], list[float]]:
    """(wall, CPU) ms of each `observe` call carrying one step of every rank, after the first
    persistence window has filled: its step records alone, or (`full`) everything a step
    ships (step records, two collective aggregates per rank, heartbeats). Called as the
    collector calls it: the step records as the columns its ingest checks built (the SDK
    ships them as one columnar block), the other records as decoded."""
    s = sim.simulate(sim.ScenarioConfig(job_id="stream", num_ranks=ranks, num_steps=steps, seed=6))
    analyzer = streaming.StreamingAnalyzer()
    analyzer.observe(next(s.records()))  # the job and its ranks
    wall, cpu = [], []
    for i in range(steps):
        batch = s.step_records(i)
        cols = columns.from_records([r for r in batch if type(r) is schema.StepRecord])
        batch = [r for r in batch if type(r) is not schema.StepRecord] if full else []
        t0, c0 = time.perf_counter(), time.thread_time()
        analyzer.observe(batch, cols)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return [w * 1000 for w in wall[10:]], [c * 1000 for c in cpu[10:]]


class _Held:
    """The analyzer as the runner sees it, its first call of a window held until every batch of
    the window is queued (the state a busy collector's runner wakes to)."""

    def __init__(self, inner: streaming.StreamingAnalyzer) -> None:
        self.inner = inner
        self.merge_steps = inner.merge_steps
        self.gate = threading.Event()

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        self.gate.wait()
        return self.inner.observe(records, steps)


def rank_batches_scale(
    ranks: int, per: int, windows: int
) -> tuple[list[float], list[float], list[int]]:
    """CPU ms per step when each of `ranks` ranks ships its own batch of `per` steps of
    ~0.25 s (a sender's 1 s flush: step records as columns, aggregates and a heartbeat as
    records), on two analyzers fed the same windows side by side: one through the collector's
    `AnalyzerRunner` with the window's batches queued (merged at each wake), the other with one
    `observe` call per batch (the runner before merging), which goes first alternating by
    window. Returns (merged, one call each, calls per merged window)."""
    warm = 4  # windows fed to both before timing, merged: the persistence window fills
    steps = (warm + windows) * per
    job = sim.ScenarioConfig(
        job_id="ranks", num_ranks=ranks, num_steps=steps, compute_s=0.2, data_s=0.01,
        transfer_s=0.04, seed=7,
    )  # fmt: skip
    s = sim.simulate(job)
    held = _Held(streaming.StreamingAnalyzer())
    alone = streaming.StreamingAnalyzer()
    for analyzer in (held.inner, alone):
        analyzer.observe(next(s.records()))
    runner = AnalyzerRunner(held, store_findings=lambda f: None, max_pending=ranks + 1)
    merged_ms: list[float] = []
    alone_ms: list[float] = []
    calls: list[int] = []

    def through_runner(batches: list[tuple[list[schema.Record], columns.StepColumns]]) -> float:
        held.gate.clear()
        calls0 = runner.calls
        futures = [runner.submit(records, cols) for records, cols in batches]
        cpu0 = time.process_time()  # this thread then only waits: the runner's CPU
        held.gate.set()
        for future in futures:
            assert future is not None, "the runner dropped a batch"
            future.result()
        calls.append(runner.calls - calls0)
        return (time.process_time() - cpu0) * 1000 / per

    def one_call_each(batches: list[tuple[list[schema.Record], columns.StepColumns]]) -> float:
        cpu0 = time.process_time()
        for records, cols in batches:
            alone.observe(records, cols)
        return (time.process_time() - cpu0) * 1000 / per

    try:
        for w in range(warm + windows):
            by_rank: dict[int, list[schema.Record]] = collections.defaultdict(list)
            for i in range(w * per, (w + 1) * per):
                for r in s.step_records(i):
                    by_rank[r.rank].append(r)
            batches = [
                (
                    [r for r in recs if type(r) is not schema.StepRecord],
                    columns.from_records([r for r in recs if type(r) is schema.StepRecord]),
                )
                for recs in by_rank.values()
            ]
            if w < warm:
                through_runner(batches)
                alone.observe(*merge(batches))
                continue
            if w % 2:
                merged_ms.append(through_runner(batches))
                alone_ms.append(one_call_each(batches))
            else:
                alone_ms.append(one_call_each(batches))
                merged_ms.append(through_runner(batches))
    finally:
        held.gate.set()
        runner.close()
    return merged_ms, alone_ms, calls[warm:]


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return float(np.median(values)), min(values), max(values)


def scale_figures(rounds: int) -> dict[str, Any]:
    """Print the analyzer's scale figures; their keys for the last line."""
    walls, cpus = offline_scale(10_000, 1_000, rounds)
    offline_cpu, offline_lo, offline_hi = median_spread(cpus)
    print(
        f"offline 10,000 ranks x 1,000 steps: {offline_cpu:.2f} s CPU "
        f"({offline_lo:.2f}-{offline_hi:.2f} over {len(cpus)} runs; "
        f"{median_spread(walls)[0]:.2f} s wall)   target <= 10 s ({offline_cpu / 10:.2f} of budget)"
    )
    out: dict[str, Any] = {
        "offline_10k_s": round(offline_cpu, 3),
        "offline_10k_s_spread": [round(offline_lo, 3), round(offline_hi, 3)],
    }
    for key, full, what in (
        ("streaming_10k_ms", False, "step records only"),
        ("streaming_10k_full_ms", True, "all it ships (+ 2 aggregates per rank, heartbeats)"),
    ):
        walls, cpus = streaming_scale(10_000, 40, full=full)
        cpu, lo, hi = median_spread(cpus)
        print(
            f"streaming step at 10,000 ranks, {what}: {cpu:.1f} ms CPU ({lo:.1f}-{hi:.1f} over "
            f"{len(cpus)} steps; {median_spread(walls)[0]:.1f} ms wall), median   "
            f"target <= 20 ms ({cpu / 20:.2f} of budget)"
        )
        out[key], out[f"{key}_spread"] = round(cpu, 2), [round(lo, 2), round(hi, 2)]
    merged, alone, calls = rank_batches_scale(10_000, 4, 5)
    cpu, lo, hi = median_spread(merged)
    one, one_lo, one_hi = median_spread(alone)
    speedup, s_lo, s_hi = median_spread([a / m for a, m in zip(alone, merged, strict=True)])
    print(
        f"streaming at 10,000 ranks, each rank's own batch of 4 steps, through the collector's "
        f"runner (queued batches merged, {min(calls)}-{max(calls)} calls a window): {cpu:.1f} ms "
        f"CPU a step ({lo:.1f}-{hi:.1f} over {len(merged)} windows); one call per batch: "
        f"{one:.0f} ms ({one_lo:.0f}-{one_hi:.0f}); {speedup:.0f}x ({s_lo:.0f}-{s_hi:.0f}) "
        "window by window"
    )
    out["streaming_10k_rank_batches_ms"] = round(cpu, 2)
    out["streaming_10k_rank_batches_ms_spread"] = [round(lo, 2), round(hi, 2)]
    out["streaming_10k_rank_batches_one_call_each_ms"] = round(one, 1)
    out["streaming_10k_rank_batches_one_call_each_ms_spread"] = [round(one_lo, 1), round(one_hi, 1)]
    out["rank_batches_merge_speedup"] = round(speedup, 1)
    out["rank_batches_merge_speedup_spread"] = [round(s_lo, 1), round(s_hi, 1)]
    print(
        "(scale figures are CPU time of the analysing thread: this machine's cores are shared, "
        "so wall time includes waiting for a core)"
    )
    return out
