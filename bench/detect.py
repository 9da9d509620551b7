"""Detection quality on jobs simulated as their ranks observe them, and the analyzer's scale.

Quality: a seeded suite of jobs from `tests/support/observed.py`: each rank's compute, data
loading and synchronous collectives are modelled (per-rank speed, +-2-15 % per-step jitter,
one-off hiccups, bursts of CPU load, per-host clock offsets, lost heartbeats), and every op's
enqueue/completion goes through the SDK's own collective recorder and step-record building, in
several layouts: DDP (buckets behind backward; 4 or 8 ranks per node), tensor parallel x data
parallel, and pipelines (pp 2-4, tp 1-2) with point-to-point sends. Faults: compute stragglers
of 1.1x, 1.25x and 2x before forward, in forward, in backward and in the optimizer step; an
intermittent one (every 4th step, 2x); a ramp (+1 % of compute per step); a data-loader stall
inside span("data"); a slow NIC on one rank (its inter-node groups move bytes 1.5-3x slower;
such a job spans 2 nodes at least);
hangs (in data loading, before forward, in backward, in the optimizer step); and clean jobs.
Non-hang jobs are analysed offline as `vigil analyze` does (all records, heartbeats included)
and, apart, online: streamed into `StreamingAnalyzer` as a collector would receive them (each
rank's step records at its flusher's next tick, heartbeats once a second, ticks every 0.5 s).
Hangs are streamed only, from 12 steps before the hang to 3x their latency budget after it.

Scoring, over every finding of every kind: a finding is right when its kind is the fault's and
it names the culprit (exactly; a slow link: among the group it names); anything else, including
a finding naming no rank where a rank was at fault, is wrong. Recall: a right finding within
20 steps of onset (hangs: within max(3 x step time, 5 s)). Culprit accuracy: of the faults that
got a finding of their kind, the share naming the culprit; kind accuracy: of the faults whose
culprit was named, the share with the right kind.

Scale (measured in `bench/detect_scale.py`, on `tests/support/simulator.py`'s arrays, which only
shape the input here): offline analysis of 10,000 ranks x 1,000 steps pinned to one core (median
of `--scale-rounds`, min-max beside it) and the streaming analyzer's per-step update at 10,000
ranks (median of 30 steps): of the step records alone, and of everything a step ships (step
records, collective aggregates, heartbeats), passed as the collector passes them (step records
as the columns its ingest built); CPU time of the analysing thread with wall time beside it.
Then the same load shipped as senders ship it, each rank its own batch of 4 steps of ~0.25 s
with one heartbeat (a 1 s flush), to two analyzers side by side, window by window: through the
collector's `AnalyzerRunner` with a window's 10,000 batches queued (a busy collector; the runner
merges them), and one `observe` call per batch (CPU a step, median of 5 windows; the speedup is
the median of the windows' own ratios). `--scale-rounds 0` measures detection quality alone (the
last line then has no scale keys).

The last line is one JSON object: {"precision", "recall", "culprit_accuracy", "kind_accuracy",
"clean_false_findings", "median_latency_steps" (offline, hangs online), "online_precision",
"online_recall", "online_clean_false_findings", "online_median_latency_steps",
"median_hang_latency_s", "cases",
"hang_culprit_accuracy", "hang_latency_ok_fraction", "straggler_precision", "straggler_recall",
"offline_10k_s", "streaming_10k_ms", "streaming_10k_full_ms",
"streaming_10k_rank_batches_ms", "streaming_10k_rank_batches_one_call_each_ms",
"rank_batches_merge_speedup" and each one's "_spread" ([min, max])}.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import arrays, engine, streaming
from vigil.analyzer import config as config_mod

# The simulators are test support (tests/support/), not shipped: run from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import detect_scale  # bench/detect_scale.py, beside this script: the scale figures

from tests.support import observed as ob
from tests.support import observed_sdk as sdk

FAULTS = (
    "clean", "straggler", "hang", "straggler", "data_stall", "slow_link", "intermittent",
    "straggler", "ramp", "hang",
)  # fmt: skip
FACTORS = (1.1, 1.25, 2.0)
POSITIONS = (ob.Position.BEFORE, ob.Position.FORWARD, ob.Position.BACKWARD, ob.Position.OPTIMIZER)
HANG_AT = (ob.Position.DATA, ob.Position.BEFORE, ob.Position.BACKWARD, ob.Position.OPTIMIZER)
WITHIN_STEPS = 20
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Case:
    name: str  # fault family, e.g. "straggler 1.25x backward"
    family: str  # clean | straggler | intermittent | ramp | data_stall | slow_link | hang
    layout: str
    cfg: ob.JobConfig
    expect: str | None  # finding kind
    culprit: int = -1
    onset: int = 0


@dataclass
class Outcome:
    case: Case
    found: list[schema.Finding]
    right: list[bool]
    recalled: bool = False
    latency: float | None = None  # steps, or seconds for a hang
    budget_s: float = 0.0


def layouts(rng: np.random.Generator, i: int) -> tuple[str, dict[str, Any]]:
    """One of the layouts, sized and mixed at random (compute share, transfers, per node)."""
    rpn = int(rng.choice([4, 8]))
    mix: dict[str, Any] = {
        "compute_s": float(rng.uniform(0.3, 1.2)),
        "data_s": float(rng.uniform(0.005, 0.05)),
        "ranks_per_node": rpn,
    }
    kind = ("ddp", "tp", "pp")[i % 3]
    if kind == "ddp":
        dp = int(rng.choice([8, 16, 32, 64, 128]))
        mix |= {
            "dp": dp,
            "buckets": int(rng.integers(2, 6)),
            "dp_transfer_s": 0.1 * mix["compute_s"],
        }
    elif kind == "tp":
        tp = int(rng.choice([t for t in (2, 4, 8) if t <= rpn]))
        dp = int(rng.choice([2, 4, 8, 16]))
        mix |= {"tp": tp, "dp": dp, "ddp": False, "layers": int(rng.integers(2, 5))}
        mix |= {"dp_transfer_s": float(rng.uniform(0.05, 0.2)) * mix["compute_s"]}
    else:
        pp, tp = int(rng.choice([2, 4])), int(rng.choice([1, 2]))
        dp = int(rng.choice([2, 4, 8]))
        mix |= {"pp": pp, "tp": tp, "dp": dp, "ddp": False, "layers": 2, "microbatches": 4}
    return kind, mix


def make_case(i: int, rng: np.random.Generator) -> Case:
    family = FAULTS[i % len(FAULTS)]
    kind, mix = layouts(rng, i)
    noise: dict[str, Any] = {
        "jitter": float(rng.uniform(0.02, 0.15)),
        "hiccup_rate": float(rng.uniform(0.0, 0.004)),
        "load_bursts": int(rng.integers(0, 3)),
        "heartbeat_loss": float(rng.uniform(0.0, 0.2)),
        "clock_offset_s": float(rng.choice([0.005, 0.2])),
    }
    cfg = ob.JobConfig(job_id=f"c{i}", seed=3000 + i, **mix, **noise)
    onset = int(rng.integers(12, 25))
    cfg = replace(cfg, num_steps=onset + WITHIN_STEPS + 5)
    culprit = int(rng.integers(cfg.num_ranks))
    layout = f"{kind} tp{cfg.tp} pp{cfg.pp} dp{cfg.dp} x{cfg.ranks_per_node}/node"
    fault: ob.Fault | None = None
    expect: str | None = None
    name = family
    if family == "clean":
        name = "clean " + ("jitter 15%", "hiccups", "cpu load")[(i // len(FAULTS)) % 3]
        cfg = replace(cfg, jitter=0.15, hiccup_rate=0.004, load_bursts=2)
    elif family in ("straggler", "intermittent", "ramp"):
        factor = float(rng.choice(FACTORS)) if family == "straggler" else 2.0
        pos = POSITIONS[int(rng.integers(len(POSITIONS)))]
        every = 4 if family == "intermittent" else 1
        ramp = 0.01 if family == "ramp" else 0.0
        fault = ob.Fault(kind=ob.FaultKind.STRAGGLER, rank=culprit, start_step=onset,
                         factor=factor, position=pos, every=every, ramp=ramp)  # fmt: skip
        expect = "straggler"
        name = {"straggler": f"straggler {factor}x {pos}", "intermittent": "intermittent 2x"}.get(
            family, "ramp 1%/step"
        )
    elif family == "data_stall":
        factor = float(rng.uniform(1.25, 2.0))
        fault = ob.Fault(kind=ob.FaultKind.STRAGGLER, rank=culprit, start_step=onset,
                         factor=factor, position=ob.Position.DATA)  # fmt: skip
        expect = "data_stall"
    elif family == "slow_link":
        if kind == "ddp":  # one world group: nothing to compare a slow group with
            kind, mix = "tp", layouts(rng, 1)[1]
            cfg = replace(cfg, **mix)
            culprit = int(rng.integers(cfg.num_ranks))
        if cfg.num_ranks <= cfg.ranks_per_node:  # one node: no group crosses a NIC
            cfg = replace(cfg, ranks_per_node=max(cfg.tp, cfg.num_ranks // 2))
        layout = f"{kind} tp{cfg.tp} pp{cfg.pp} dp{cfg.dp} x{cfg.ranks_per_node}/node"
        fault = ob.Fault(kind=ob.FaultKind.SLOW_LINK, rank=culprit, start_step=onset,
                         factor=float(rng.uniform(1.5, 3.0)))  # fmt: skip
        expect = "slow_link"
    elif family == "hang":
        pos = HANG_AT[int(rng.integers(len(HANG_AT)))]
        fault = ob.Fault(kind=ob.FaultKind.HANG, rank=culprit, start_step=onset, position=pos)
        expect, name = "hang", f"hang in {pos}"
    if fault is not None:
        cfg = replace(cfg, faults=(fault,))
    return Case(name, family, layout, cfg, expect, culprit, onset)


def right(case: Case, f: schema.Finding) -> bool:
    if case.expect is None or f.kind != case.expect:
        return False
    if case.expect == "slow_link":
        return case.culprit in f.subjects.ranks
    return f.subjects.ranks == [case.culprit]


def run_offline(case: Case, job: ob.Job) -> Outcome:
    """Analyse everything the job shipped at once, as `vigil analyze` does."""
    records = job.all_records()
    a = arrays.from_records(records, job_id=case.cfg.job_id)
    cfg = config_mod.AnalyzerConfig()
    found = engine.analyze_arrays(a, cfg)
    found += engine.replay_hang(a, records, engine.newest_time_s(records), cfg.hang)
    out = Outcome(case, found, [right(case, f) for f in found])
    for f, ok in zip(found, out.right, strict=True):
        if ok:
            row = min(int(np.searchsorted(a.step_end_s, f.detected_s)), a.num_steps - 1)
            steps = int(a.steps[row]) - case.onset
            if out.latency is None or steps < out.latency:
                out.latency = steps
    out.recalled = out.latency is not None and out.latency <= WITHIN_STEPS
    return out


def stream(
    case: Case, job: ob.Job, start: float, end: float
) -> tuple[list[schema.Finding], float | None]:
    """Feed the job to a `StreamingAnalyzer` as a collector receives it (records shipped
    before `start` at once, then every 0.5 s, or at its `due_s`, what arrived, and a tick)
    until `end`; its findings in their last state and when the first right one came."""
    analyzer = streaming.StreamingAnalyzer()
    shipped = sorted(job.shipped, key=lambda s: s[0])
    analyzer.observe([*job.records, *(r for t, batch in shipped if t < start for r in batch)])
    later = [(t, batch) for t, batch in shipped if t >= start]
    beats = list(job.heartbeats(start, end))
    found: dict[str, schema.Finding] = {}
    first_right: float | None = None
    now, b, h = start, 0, 0
    while now < end:
        # Every 0.5 s, and as a hang's silence passes its threshold (the collector's ticks).
        due = analyzer.due_s()
        now = due if due is not None and now < due < now + 0.5 else now + 0.5
        batch: list[schema.Record] = []
        while b < len(later) and later[b][0] <= now:
            batch.extend(later[b][1])
            b += 1
        while h < len(beats) and beats[h][0] <= now:
            batch.append(beats[h][1])
            h += 1
        for f in [*analyzer.observe(batch), *analyzer.tick(now)]:
            found[f.finding_id] = f
            if first_right is None and right(case, f):
                first_right = now
    return list(found.values()), first_right


def step_ends(job: ob.Job) -> F64:
    """True time the last rank ended each step."""
    ends = [rank.page.step_end for rank in job.ranks]
    return np.array([max(e[i] for e in ends if len(e) > i) for i in range(job.steps_done)])


def run_online(case: Case, job: ob.Job) -> Outcome:
    """Stream the whole job; latency in steps from the step that had ended when it came."""
    found, first = stream(case, job, sdk.T0, job.end_s() + 2.0)
    out = Outcome(case, found, [right(case, f) for f in found])
    if first is not None:
        row = min(int(np.searchsorted(step_ends(job), first)), job.steps_done - 1)
        out.latency = row - case.onset
        out.recalled = out.latency <= WITHIN_STEPS
    return out


def run_hang(case: Case, job: ob.Job) -> Outcome:
    """Stream a hung job from 12 steps before the hang until 3x the budget after it."""
    assert job.hang is not None
    onset = job.hang.onset_s
    pages = [rank.page for rank in job.ranks]
    times = [e - span[0] for p in pages for span, e in zip(p.data_spans, p.step_end, strict=False)]
    step_s = float(np.median(times))
    budget = max(3 * step_s, 5.0)
    found, first = stream(case, job, onset - 12 * step_s, onset + 3 * budget)
    out = Outcome(case, found, [right(case, f) for f in found], budget_s=budget)
    if first is not None:
        out.latency = first - onset
        out.recalled = out.latency <= budget
    return out


@dataclass
class Score:
    findings: int = 0
    right_findings: int = 0
    faults: int = 0
    recalled: int = 0
    kind_found: int = 0
    kind_found_culprit: int = 0
    culprit_named: int = 0
    culprit_named_kind: int = 0
    clean_findings: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        case = o.case
        self.findings += len(o.found)
        self.right_findings += sum(o.right)
        if case.expect is None:
            self.clean_findings += len(o.found)
            return
        self.faults += 1
        self.recalled += int(o.recalled)
        if o.latency is not None:
            self.latencies.append(o.latency)
        of_kind = [f for f in o.found if f.kind == case.expect]
        naming = [f for f in o.found if case.culprit in f.subjects.ranks]
        if of_kind:
            self.kind_found += 1
            self.kind_found_culprit += int(any(right(case, f) for f in of_kind))
        if naming:
            self.culprit_named += 1
            self.culprit_named_kind += int(any(f.kind == case.expect for f in naming))

    def ratios(self) -> dict[str, float]:
        def r(a: int, b: int) -> float:
            return round(a / b, 4) if b else float("nan")

        return {
            "precision": r(self.right_findings, self.findings) if self.findings else 1.0,
            "recall": r(self.recalled, self.faults),
            "culprit_accuracy": r(self.kind_found_culprit, self.kind_found),
            "kind_accuracy": r(self.culprit_named_kind, self.culprit_named),
        }


def suite(n: int, seed: int) -> tuple[list[Outcome], list[Outcome]]:
    """(offline outcomes, online outcomes); a hang's job is analysed online only."""
    rng = np.random.default_rng(seed)
    offline, online = [], []
    for i in range(n):
        case = make_case(i, rng)
        job = ob.run(case.cfg)
        if case.family == "hang":
            online.append(run_hang(case, job))
        else:
            offline.append(run_offline(case, job))
            online.append(run_online(case, job))
    return offline, online


def table(outcomes: list[Outcome], key: str, of: Callable[[Case], str]) -> None:
    groups: dict[str, Score] = collections.defaultdict(Score)
    for o in outcomes:
        groups[of(o.case)].add(o)
    print(f"{key:26s} {'cases':>5s} {'prec':>6s} {'recall':>6s} {'culprit':>7s} {'kind':>6s} "
          f"{'latency':>8s} {'findings':>8s}")  # fmt: skip
    counts = collections.Counter(of(o.case) for o in outcomes)
    for name in sorted(groups):
        s, r = groups[name], groups[name].ratios()
        lat = f"{np.median(s.latencies):.1f}" if s.latencies else "-"
        print(
            f"{name:26s} {counts[name]:5d} {r['precision']:6.2f} {r['recall']:6.2f} "
            f"{r['culprit_accuracy']:7.2f} {r['kind_accuracy']:6.2f} {lat:>8s} {s.findings:8d}"
        )


def wrong_examples(outcomes: list[Outcome], limit: int) -> None:
    shown = 0
    for o in outcomes:
        for f, ok in zip(o.found, o.right, strict=True):
            if not ok and shown < limit:
                shown += 1
                print(f"  wrong in [{o.case.name}; {o.case.layout}; culprit {o.case.culprit}]: "
                      f"{f.summary[:150]}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=120)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument(
        "--scale-rounds", type=int, default=3,
        help="offline scale runs (median); 0: detection quality only, no scale figures",
    )  # fmt: skip
    parser.add_argument("--show-wrong", type=int, default=12, help="wrong findings to print")
    args = parser.parse_args()
    if args.scale_rounds < 0:
        parser.error(f"--scale-rounds must be >= 0, got {args.scale_rounds}")
    if args.cases < 1:
        parser.error(f"--cases must be >= 1, got {args.cases}")
    t0 = time.perf_counter()
    offline, online = suite(args.cases, args.seed)
    outcomes = offline + [o for o in online if o.case.family == "hang"]
    total, live = Score(), Score()
    for o in outcomes:
        total.add(o)
    for o in online:
        live.add(o)
    ranks = max(o.case.cfg.num_ranks for o in outcomes)
    print(f"suite: {len(outcomes)} jobs (8-{ranks} ranks) in {time.perf_counter() - t0:.0f} s; "
          "hangs streamed, the rest analysed offline (vigil analyze):")  # fmt: skip
    table(outcomes, "case", lambda c: c.name)
    table(outcomes, "layout", lambda c: c.layout.split()[0])
    wrong_examples(outcomes, args.show_wrong)
    print("the same jobs streamed into the collector's analyzer (online):")
    table(online, "fault", lambda c: c.family)
    wrong_examples([o for o in online if o.case.family != "hang"], args.show_wrong)
    r, lr = total.ratios(), live.ratios()
    hangs, stragglers = Score(), Score()
    for o in outcomes:
        if o.case.family in ("hang", "straggler"):
            (hangs if o.case.family == "hang" else stragglers).add(o)
    hr, sr = hangs.ratios(), stragglers.ratios()
    hang_lat = [o.latency for o in outcomes if o.case.family == "hang" and o.latency is not None]
    straggler_findings = [
        ok
        for o in outcomes
        for f, ok in zip(o.found, o.right, strict=True)
        if f.kind == "straggler"
    ]
    steps = [o.latency for o in offline if o.latency is not None]
    live_steps = [o.latency for o in online if o.case.family != "hang" and o.latency is not None]
    print("                               offline   online   target")
    print(f"precision (every finding kind) {r['precision']:7.4f}  {lr['precision']:7.4f}   1.0 "
          f"({total.findings} findings, {total.right_findings} right; online {live.findings}, "
          f"{live.right_findings})")  # fmt: skip
    for key, target in (("recall", "1.0 (>= 0.9 at 1.1x)"), ("culprit_accuracy", "1.0"),
                        ("kind_accuracy", "1.0")):  # fmt: skip
        print(f"{key.replace('_', ' '):30s} {r[key]:7.4f}  {lr[key]:7.4f}   {target}")
    clean = [o for o in outcomes if o.case.expect is None]
    print(
        f"clean jobs' findings           {total.clean_findings:7d}  {live.clean_findings:7d}   0 "
        f"(offline: in {sum(bool(o.found) for o in clean)} of {len(clean)} clean jobs)"
    )
    scale = detect_scale.scale_figures(args.scale_rounds) if args.scale_rounds else {}
    print(
        json.dumps(
            {
                **r,
                "clean_false_findings": total.clean_findings,
                "median_latency_steps": float(np.median(steps)) if steps else None,
                "online_precision": lr["precision"],
                "online_recall": lr["recall"],
                "online_clean_false_findings": live.clean_findings,
                "online_median_latency_steps": (
                    float(np.median(live_steps)) if live_steps else None
                ),
                "median_hang_latency_s": round(float(np.median(hang_lat)), 2) if hang_lat else None,
                "cases": len(outcomes),
                "hang_culprit_accuracy": hr["culprit_accuracy"],
                "hang_latency_ok_fraction": hr["recall"],
                "straggler_precision": round(
                    sum(straggler_findings) / max(1, len(straggler_findings)), 4
                ),
                "straggler_recall": sr["recall"],
                **scale,
            }
        )
    )


if __name__ == "__main__":
    main()
