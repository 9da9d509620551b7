"""Detection quality and speed of the analyzer on the seeded fault-scenario simulator.

One run measures, side by side with each target:
  - a suite of >= 200 scenarios (8 to 4,096 ranks; hangs, stragglers of 1.1x-2x, slow links,
    data stalls, throttled GPUs, clean jobs; per-step jitter 1-3.5 %, job-wide swing 1-4 %,
    per-rank speed spread 0.5-1.5 %, heavy-tailed pauses): hangs are streamed through
    `StreamingAnalyzer` (recent steps, then heartbeats and ticks every 0.5 s after the hang)
    and must be flagged within max(3 x median step time, 5 s) of onset naming the culprit;
    stragglers are found by
    the offline detectors and must be flagged within 20 steps of onset; straggler precision
    counts every straggler finding in every scenario (throttled GPUs are true stragglers);
  - 10,000 clean steps at 1,024 ranks: every detector, zero findings expected;
  - scale: offline analysis of 10,000 ranks x 1,000 steps pinned to one core (median of
    `--scale-rounds` runs, min-max beside it), and the streaming analyzer's per-step update at
    10,000 ranks (one step's StepRecords per `observe` call; median over 50 steps, min-max
    beside it); both as CPU time of the analysing thread, with wall time printed beside it.
The last line is one JSON object: {"hang_culprit_accuracy", "hang_latency_ok_fraction",
"straggler_precision", "straggler_recall", "clean_false_findings", "offline_10k_s",
"streaming_10k_ms"} (the scale figures medians), and beside them {"offline_10k_s_spread",
"streaming_10k_ms_spread"} ([min, max] CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vigil import schema
from vigil.analyzer import engine, streaming

# The simulator is test support (tests/support/), not shipped: run from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import simulator as sim

KINDS = ("hang", "straggler", "hang", "straggler", "slow_link", "data_stall", "throttle", "clean")


@dataclass
class Tally:
    hangs: int = 0
    culprit_ok: int = 0
    latency_ok: int = 0
    stragglers: int = 0
    recalled: int = 0
    straggler_findings: int = 0
    true_straggler_findings: int = 0


def scenario(i: int, rng: np.random.Generator) -> sim.ScenarioConfig:
    kind = KINDS[i % len(KINDS)]
    ranks = max(8, int(2 ** rng.uniform(3, 12)) // 8 * 8)
    onset = int(rng.integers(15, 35))
    rank = int(rng.integers(ranks))
    nodes = max(1, ranks // 8)
    faults: tuple[sim.Fault, ...] = ()
    steps = onset + 30
    if kind == "hang":
        faults = (
            sim.Fault(
                kind=sim.FaultKind.HANG,
                rank=rank,
                start_step=onset,
                collective=int(rng.integers(3)),
            ),
        )
    elif kind == "straggler":
        faults = (
            sim.Fault(
                kind=sim.FaultKind.STRAGGLER,
                ranks=(rank,),
                factor=float(rng.uniform(1.1, 2.0)),
                start_step=onset,
            ),
        )
    elif kind == "slow_link" and nodes >= 4:
        a, b = (int(x) for x in rng.choice(nodes, 2, replace=False))
        faults = (
            sim.Fault(
                kind=sim.FaultKind.SLOW_LINK,
                nodes=(a, b),
                factor=float(rng.uniform(1.3, 3.0)),
                start_step=onset,
            ),
        )
    elif kind == "data_stall":
        faults = (
            sim.Fault(
                kind=sim.FaultKind.DATA_STALL,
                ranks=(rank,),
                extra_s=float(rng.uniform(0.1, 0.5)),
                start_step=onset,
            ),
        )
    elif kind == "throttle":
        faults = (
            sim.Fault(
                kind=sim.FaultKind.THROTTLE,
                ranks=(rank,),
                factor=float(rng.uniform(0.5, 0.85)),
                start_step=onset,
            ),
        )
    noise = {  # every scenario draws its own noise level
        "jitter": float(rng.uniform(0.01, 0.035)),
        "step_swing": float(rng.uniform(0.01, 0.04)),
        "rank_spread": float(rng.uniform(0.005, 0.015)),
        "hiccup_rate": float(rng.uniform(0.0, 5e-5)),
    }
    return sim.ScenarioConfig(
        job_id=f"s{i}", num_ranks=ranks, num_steps=steps, faults=faults, seed=1000 + i, **noise
    )


def run_hang(s: sim.Simulation, tally: Tally) -> None:
    assert s.hang is not None
    analyzer = streaming.StreamingAnalyzer()
    batches = s.records()
    analyzer.observe(next(batches))  # job and rank info
    for i in range(max(0, s.arrays.num_steps - 12), s.arrays.num_steps):
        analyzer.observe(s.step_records(i))
    budget = max(3 * float(np.median(s.arrays.step_time_s)), 5.0)
    t, found = s.hang.onset_s, None
    while found is None and t < s.hang.onset_s + 3 * budget:
        t += 0.5
        raised = [*analyzer.observe(s.positions_at(t)), *analyzer.tick(t)]
        found = next((f for f in raised if f.kind == schema.FindingKind.HANG), None)
    tally.hangs += 1
    if found is not None:
        tally.latency_ok += int(t - s.hang.onset_s <= budget)
        tally.culprit_ok += int(found.subjects.ranks == [s.hang.rank])


def run_offline(s: sim.Simulation, tally: Tally) -> None:
    found = engine.analyze_arrays(s.arrays)
    stragglers = {
        r
        for f in s.config.faults
        if f.kind in (sim.FaultKind.STRAGGLER, sim.FaultKind.THROTTLE)
        for r in f.ranks
    }
    for f in found:
        if f.kind == schema.FindingKind.STRAGGLER:
            tally.straggler_findings += 1
            tally.true_straggler_findings += int(set(f.subjects.ranks) <= stragglers)
    for fault in s.config.faults:
        if fault.kind is not sim.FaultKind.STRAGGLER:
            continue
        tally.stragglers += 1
        for f in found:
            if f.kind == schema.FindingKind.STRAGGLER and f.subjects.ranks == list(fault.ranks):
                row = int(np.searchsorted(s.arrays.step_end_s, f.detected_s))
                if int(s.arrays.steps[min(row, s.arrays.num_steps - 1)]) - fault.start_step <= 20:
                    tally.recalled += 1
                    break


def suite(n: int, seed: int) -> Tally:
    rng = np.random.default_rng(seed)
    tally = Tally()
    for i in range(n):
        s = sim.simulate(scenario(i, rng))
        if s.hang is not None:
            run_hang(s, tally)
        else:
            run_offline(s, tally)
    return tally


def clean_run(ranks: int, steps: int) -> int:
    s = sim.simulate(sim.ScenarioConfig(job_id="clean", num_ranks=ranks, num_steps=steps, seed=77))
    found = engine.analyze_arrays(s.arrays)
    hang = engine.replay_hang(
        s.arrays, [], float(s.arrays.step_end_s[-1]) + 0.5, engine.config_mod.HangConfig()
    )
    return len(found) + len(hang)


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


def streaming_scale(ranks: int, steps: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) ms of each `observe` call carrying one step of every rank, after the first
    persistence window has filled."""
    a = sim.simulate(
        sim.ScenarioConfig(job_id="stream", num_ranks=ranks, num_steps=steps, seed=6)
    ).arrays
    batches = []
    for i in range(steps):
        start = float(a.step_start_s[i])
        batches.append(
            [
                schema.StepRecord(
                    job_id="stream",
                    rank=r,
                    step=i,
                    start_s=start,
                    end_s=start + float(a.step_time_s[i, r]),
                    data_s=float(a.data_s[i, r]),
                    comm_wait_s=float(a.comm_wait_s[i, r]),
                    tokens=int(a.tokens[i, r]),
                    mfu=float(a.mfu[i, r]),
                )
                for r in range(ranks)
            ]
        )
    analyzer = streaming.StreamingAnalyzer()
    wall, cpu = [], []
    for batch in batches:
        t0, c0 = time.perf_counter(), time.thread_time()
        analyzer.observe(batch)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return [w * 1000 for w in wall[10:]], [c * 1000 for c in cpu[10:]]


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return float(np.median(values)), min(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", type=int, default=208)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--scale-rounds", type=int, default=3, help="offline scale runs (median)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    tally = suite(args.scenarios, args.seed)
    hang_acc = tally.culprit_ok / max(1, tally.hangs)
    hang_lat = tally.latency_ok / max(1, tally.hangs)
    precision = tally.true_straggler_findings / max(1, tally.straggler_findings)
    recall = tally.recalled / max(1, tally.stragglers)
    print(
        f"suite: {args.scenarios} scenarios in {time.perf_counter() - t0:.0f} s "
        f"({tally.hangs} hangs, {tally.stragglers} stragglers)"
    )
    print(f"hang culprit accuracy     {hang_acc:8.4f}   target >= 0.99")
    print(f"hang latency within bound {hang_lat:8.4f}   target >= 0.99")
    print(
        f"straggler precision       {precision:8.4f}   target >= 0.99 "
        f"({tally.straggler_findings} findings)"
    )
    print(f"straggler recall (20 st.) {recall:8.4f}   target >= 0.99")
    clean = clean_run(1024, 10_000)
    print(f"clean 1,024 ranks x 10,000 steps: {clean} findings   target 0")
    walls, cpus = offline_scale(10_000, 1_000, args.scale_rounds)
    offline_cpu, offline_lo, offline_hi = median_spread(cpus)
    print(
        f"offline 10,000 ranks x 1,000 steps: {offline_cpu:.2f} s CPU "
        f"({offline_lo:.2f}-{offline_hi:.2f} over {len(cpus)} runs; "
        f"{median_spread(walls)[0]:.2f} s wall)"
        f"   target <= 10 s ({offline_cpu / 10:.2f} of budget)"
    )
    walls, cpus = streaming_scale(10_000, 60)
    stream_cpu, stream_lo, stream_hi = median_spread(cpus)
    print(
        f"streaming step at 10,000 ranks: {stream_cpu:.1f} ms CPU "
        f"({stream_lo:.1f}-{stream_hi:.1f} over {len(cpus)} steps; "
        f"{median_spread(walls)[0]:.1f} ms wall), median   target <= 20 ms "
        f"({stream_cpu / 20:.2f} of budget)"
    )
    print(
        "(scale figures are CPU time of the analysing thread: this machine's cores are shared, "
        "so wall time includes waiting for a core)"
    )
    print(
        json.dumps(
            {
                "hang_culprit_accuracy": round(hang_acc, 4),
                "hang_latency_ok_fraction": round(hang_lat, 4),
                "straggler_precision": round(precision, 4),
                "straggler_recall": round(recall, 4),
                "clean_false_findings": clean,
                "offline_10k_s": round(offline_cpu, 3),
                "streaming_10k_ms": round(stream_cpu, 2),
                "offline_10k_s_spread": [round(offline_lo, 3), round(offline_hi, 3)],
                "streaming_10k_ms_spread": [round(stream_lo, 2), round(stream_hi, 2)],
            }
        )
    )


if __name__ == "__main__":
    main()
