"""The real-job fault matrix: do vigil's findings name the right rank, kind and time?

    python bench/faults.py [--wrappers ddp,fsdp,tp,pp,plain] [--seeds 2] [--quick]
    python bench/faults.py --long 2000 --seeds 1   # false alarms over long fault-free jobs

Real 4-rank gloo jobs (`tests/realjobs/train.py`: a user's own loop instrumented only through
the public SDK) for each wrapper (DDP, FSDP2, DTensor TP, 1F1B pipeline, a plain loop calling
dist.all_reduce) x faults injected by the job itself:
  - compute stragglers making the job 1.1x, 1.25x and 2x slower, before forward (in a pipeline,
    a slow forward layer), inside backward (a slow layer) and in the optimizer step;
  - an intermittent straggler (2x every 4th step) and a ramp (1 % slower per step);
  - data-loader stalls (inside `span("data")`, kind data_stall) at 1.25x and 2x;
  - hangs of 8 s: before a collective, inside a collective no peer joins, in data loading and
    in a checkpoint save; a crash (os._exit);
  - a noisy neighbour: busy processes in rank 2's session (the kernel's autogroup scheduling
    then gives them rank 2's share of the CPU), 150 steps: a rank that waits for a CPU is
    reported once that has lasted 3 s;
  - clean jobs: ±15 % per-step jitter, one-off hiccups, a busy process on every core (in
    sessions of their own), `--seeds` seeds each;
  - a real slow link (wrapper fsdp_tp: TP within pairs of ranks, FSDP2 across them): rank 3 in
    a network namespace of its own, behind a veth pair that `tc tbf` limits, on a node of its
    own; the same job clean, through the same veth without the limit on rank 3's side.
Cases run one after another in one launch per wrapper (a crash in its own launch). Every rank
ships to a real `vigil collector` (SQLite, its streaming analyzer on) and keeps a JSONL copy
(with `--relay`, through its node's relay: ranks 0-1 and 2-3 as two nodes, each relay as `vigil
agent --relay-port` runs it; the last line then also holds `relayed_batches`, `relay_requests`);
every case is analysed offline (`vigil analyze --json`, a subprocess, as a user runs it) and
online (the collector's findings API).

Scoring, per case and mode: a fault case is detected when some finding names the culprit rank;
its first such finding gives kind accuracy and latency (steps and seconds from the fault's first
step to the finding's `detected_s`); culprit accuracy is whether the first finding of the case
names exactly the culprit. Precision counts every finding of every kind: correct ones name the
culprit with an acceptable kind (for a straggler also mfu_drop); every finding on a clean job is
false (`clean_false_findings`; `clean_steps` counts their steps, once per mode, and
`false_findings_per_10k_steps` relates the two). `shape_accuracy`: of the stragglers and data
stalls found, the share whose first finding said the fault's shape (analyzer/shape.py: an
intermittent straggler intermittent, a ramp growing, the rest steady). `recall_on_time`: the
share of faults detected within the deadlines the targets set (stragglers and data stalls within
20 steps of onset, hangs within max(3 x step time, 5 s); other faults, and the neighbour, whose
slowness has no first step, have none). The last line is one JSON object with precision,
recall, recall_on_time, culprit_accuracy, kind_accuracy, clean_false_findings,
clean_steps, false_findings_per_10k_steps, median_latency_steps, shape_accuracy, cases (pooled
over both modes), and the same per mode and for the targeted subsets (stragglers >= 1.25x,
hangs, stragglers at 1.1x).

`--long STEPS` runs only the clean jobs, each STEPS steps long, with a hiccup every 50 steps: a
false alarm rare enough to miss in 40-step jobs shows over thousands of steps, as it would over
a real job's hours.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.realjobs import launch as launcher  # noqa: E402
from tests.realjobs import netns, train  # noqa: E402
from vigil import schema  # noqa: E402
from vigil.agent import relay  # noqa: E402
from vigil.analyzer import shape  # noqa: E402

WRAPPERS = ("ddp", "fsdp", "tp", "pp", "plain", "fsdp_tp")
FAULT_STEP = train.WARMUP + 2  # the first faulty step (Case.slow_delay's default from_step)
STEPS = 40
# The deadlines: stragglers within this many steps of onset, hangs within
# max(3 x step time, this many seconds).
WITHIN_STEPS = 20
HANG_BUDGET_S = 5.0
# A straggler flagged for its wait for a CPU is reported once its episode has lasted
# `StragglerConfig.min_cpu_wait_episode_s` (3 s): ~110 of the pipeline's ~27 ms steps.
NEIGHBOUR_STEPS = 150
HANG_S = 8.0
# Acceptable finding kinds per fault kind (a straggler also slows the job: an mfu_drop that
# names the culprit is right too).
ACCEPT = {
    "straggler": {"straggler", "mfu_drop"},
    "data_stall": {"data_stall", "mfu_drop"},
    "hang": {"hang"},
    "crash": {"crash", "hang"},
    "slow_link": {"slow_link"},
}


@dataclass
class Spec:
    wrapper: str
    name: str
    kind: str  # expected kind, or "clean"
    rank: int = -1
    onset: int = FAULT_STEP
    group: str = ""  # what the case is counted under (e.g. "straggler 1.25x backward")
    case: dict[str, Any] = field(default_factory=dict)
    online: list[dict[str, Any]] | None = None  # fetched early (the slow link's collector)

    @property
    def job(self) -> str:
        return f"{self.wrapper}-{self.name}"


def specs_for(wrapper: str, seeds: int, quick: bool) -> tuple[list[Spec], list[Spec]]:
    """(cases run in one launch, cases that end their launch: the crash)."""
    out: list[Spec] = []

    def add(
        name: str, expect: str, culprit: int, group: str, steps: int = STEPS, **fault: Any
    ) -> None:
        case = {"job": f"{wrapper}-{name}", "steps": steps, "seed": len(out) + 1}
        if fault:
            case["fault"] = fault
        onset = int(fault.get("step", FAULT_STEP)) if fault else FAULT_STEP
        out.append(Spec(wrapper, name, expect, culprit, onset, group, case))

    factors = (1.25,) if quick else (1.1, 1.25, 2.0)
    positions = ("forward",) if quick else ("forward", "backward", "optimizer")
    rank = 1
    for factor in factors:
        for where in positions:
            rank = (rank + 1) % 4
            add(
                f"slow{factor}-{where}", "straggler", rank, f"straggler {factor}x",
                kind="slow", rank=rank, factor=factor, where=where,
            )  # fmt: skip
    if not quick:
        add("intermittent", "straggler", 3, "intermittent 2x every 4th step",
            kind="slow", rank=3, factor=2.0, every=4)  # fmt: skip
        add("ramp", "straggler", 2, "ramp 1%/step", steps=STEPS + 10,
            kind="slow", rank=2, ramp=0.01)  # fmt: skip
    for factor in (1.25,) if quick else (1.25, 2.0):
        add(f"data{factor}", "data_stall", 1, f"data stall {factor}x",
            kind="slow", rank=1, factor=factor, where="data")  # fmt: skip
    if not quick:  # busy processes in one rank's session: they take its CPU share
        case = {
            "job": f"{wrapper}-neighbour",
            "steps": NEIGHBOUR_STEPS,
            "seed": 77,
            "noise": {"kind": "cpu_hog", "host_rank": 2, "shared": True},
        }
        out.append(Spec(wrapper, "neighbour", "straggler", 2, 0, "noisy neighbour", case))
    hang_step = FAULT_STEP + 6
    for where in ("before",) if quick else ("before", "collective", "data", "checkpoint"):
        add(f"hang-{where}", "hang", 1, f"hang {where}", steps=hang_step + 6,
            kind="hang", rank=1, step=hang_step, seconds=HANG_S, where=where)  # fmt: skip
    out += clean_specs(wrapper, seeds, STEPS)
    crash = Spec(wrapper, "crash", "crash", 3, FAULT_STEP + 4, "crash",
                 {"job": f"{wrapper}-crash", "steps": STEPS, "seed": 99,
                  "fault": {"kind": "crash", "rank": 3, "step": FAULT_STEP + 4}})  # fmt: skip
    return out, [] if quick else [crash]


def clean_specs(wrapper: str, seeds: int, steps: int) -> list[Spec]:
    """Fault-free jobs of `steps` steps, `seeds` of each noise: ±15 % per-step jitter, one-off
    hiccups (a rank 3x slower for a step: 2 a job, one per 50 steps in longer jobs), a busy
    process on every core."""
    out = []
    long = steps > STEPS
    for seed in range(1, seeds + 1):
        for noise in ("jitter", "hiccup", "cpu_hog"):
            name = f"{'long-' if long else ''}clean-{noise}-{seed}"
            case = {
                "job": f"{wrapper}-{name}",
                "steps": steps,
                "seed": (200 if long else 100) + seed,
            }
            case["noise"] = {"kind": noise, "share": 0.15, "count": max(2, steps // 50)}
            group = f"{'long ' if long else ''}clean {noise}"
            out.append(Spec(wrapper, name, "clean", group=group, case=case))
    return out


SLOW_RANK = 3


def run_slow_link(work: Path, seeds: int) -> list[Spec]:
    """A 2-D job (TP within pairs, FSDP2 across) clean, then with rank 3 behind a veth pair
    that `tc tbf` limits, in a network namespace of its own (on a node of its own: a slow NIC)."""
    if not netns.available():
        print("slow link: needs root, iproute2 and network namespaces; skipped")
        return []
    clean = [
        Spec("fsdp_tp", f"clean-jitter-{seed}", "clean", group="clean jitter",
             case={"job": f"fsdp_tp-clean-jitter-{seed}", "steps": STEPS, "seed": 200 + seed,
                   "noise": {"kind": "jitter", "share": 0.15}})
        for seed in range(1, seeds + 1)
    ]  # fmt: skip
    slow = [
        Spec("fsdp_tp", f"slow-link-{seed}", "slow_link", SLOW_RANK, 0, "slow link (tbf)",
             {"job": f"fsdp_tp-slow-link-{seed}", "steps": STEPS, "seed": 300 + seed})
        for seed in range(1, seeds + 1)
    ]  # fmt: skip
    out: list[Spec] = []
    with netns.slow_link(LINK_RATE) as link:
        # Its own collector, on this side of the link: the rank inside reaches only that address.
        token = secrets.token_hex(16)
        collector = Collector(work / "link-collector", host=link.outside_addr, token=token)
        outside = {"VIGIL_NODE": "host-a", "GLOO_SOCKET_IFNAME": link.outside_dev}
        outside["VIGIL_TOKEN"] = token
        for batch, limited in ((clean, False), (slow, True)):
            env = {r: dict(outside) for r in range(4)}
            prefix: dict[int, list[str]] = {}
            if limited:
                env[SLOW_RANK] = {**outside, "VIGIL_NODE": "host-b"}
                env[SLOW_RANK]["GLOO_SOCKET_IFNAME"] = link.inside_dev
                prefix[SLOW_RANK] = link.prefix
            result = launcher.launch(
                "fsdp_tp", [s.case for s in batch], work / "out", collector=collector.url,
                progress_dir=work / "pages", timeout_s=900, rank_env=env, rank_prefix=prefix,
                master_addr=link.outside_addr,
            )  # fmt: skip
            if max(result.exit_codes):
                print(f"fsdp_tp: launch exit codes {result.exit_codes}; see {result.logs}")
            print(f"fsdp_tp: {len(batch)} case(s) in {result.seconds:.0f} s", flush=True)
            out.extend(batch)
        time.sleep(3.0)  # the last flushes and the analyzer's queue
        for spec in out:
            spec.online = online_findings(collector, spec.job)
        collector.stop()
    return out


# A link a tenth of loopback's speed and less: the 2-D job's activations cross it every layer.
LINK_RATE = "200mbit"


# -- running ----------------------------------------------------------------------------------
class Collector:
    """A real `vigil collector` on loopback with SQLite and its streaming analyzer."""

    def __init__(self, work: Path, host: str = "127.0.0.1", token: str | None = None) -> None:
        self.port = launcher.free_port()
        self.url = f"http://{host}:{self.port}"
        self.token = token
        work.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VIGIL_DATA_DIR": str(work / "collector")}
        env.pop("VIGIL_TOKEN", None)
        if token:  # off loopback the collector needs one (our own veth address, no further)
            env["VIGIL_TOKEN"] = token
        self.log = open(work / "collector.log", "wb")  # noqa: SIM115
        store = f"sqlite:///{work / 'collector.sqlite3'}"
        cmd = [sys.executable, "-m", "vigil", "collector", "--host", host, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, "--store", store],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.get("/api/v1/jobs")
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"collector did not start; see {work / 'collector.log'}")

    def get(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.log.close()


def offline_findings(folder: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "vigil", "analyze", str(folder), "--json", "--no-progress"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode not in (0, 1):
        raise RuntimeError(f"vigil analyze {folder} failed: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout)["findings"])


def online_findings(collector: Collector, job: str) -> list[dict[str, Any]]:
    found = collector.get(f"/api/v1/jobs/{job}/findings?limit=1000")
    return list(found)


def step_times(folder: Path, spec: Spec) -> tuple[float, list[tuple[int, float]]]:
    """The wall-clock start of the first faulty step (the culprit's own record; rank 0's on a
    clean job) and (step, end) of every step, when its last rank ended it: the time a finding's
    `detected_s` is on (the culprit itself may end a step a few ms before its peers)."""
    onset, last_end = float("nan"), {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        culprit = path.name == f"rank-{max(spec.rank, 0):05d}.jsonl"
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("type") != "step":
                continue
            step, end = int(record["step"]), float(record["end_s"])
            last_end[step] = max(last_end.get(step, end), end)
            if culprit and step == spec.onset:
                onset = float(record["start_s"])
    ends = sorted(last_end.items())
    if onset != onset:  # the culprit died before the fault's step started: the last end
        before = [end for step, end in ends if step < spec.onset]
        onset = max(before) if before else onset
    return onset, ends


# -- scoring ----------------------------------------------------------------------------------
@dataclass
class Score:
    spec: Spec
    mode: str
    findings: list[dict[str, Any]]
    detected: bool = False
    culprit_ok: bool = False
    kind_ok: bool = False
    correct: int = 0
    latency_steps: float | None = None
    latency_s: float | None = None
    # Detected within the deadline (`on_time`): stragglers and stalls within
    # `WITHIN_STEPS` steps of onset, hangs within max(3 x step time, 5 s); other faults (crash,
    # slow link, the neighbour, whose slowness has no first step) have none: detected is on time.
    on_time: bool = False
    # The shape the case's fault has (`expected_shape`) and the one its first finding of a
    # straggler or data-stall kind naming the culprit said (`said_shape`); None: not judged.
    want_shape: str | None = None
    shape: str | None = None


def expected_shape(spec: Spec) -> str | None:
    """How the fault's slowness is spread over its steps (analyzer/shape.py's words); None for a
    fault without one (hangs, crashes, links, the neighbour's bursty CPU share)."""
    if spec.group.startswith("intermittent"):
        return "intermittent"
    if spec.group.startswith("ramp"):
        return "growing"
    return "steady" if spec.group.startswith(("straggler ", "data stall")) else None


def said_shape(finding: dict[str, Any]) -> str:
    return shape.said(msgspec.convert(finding["evidence"], list[schema.Evidence])).value


def score(
    spec: Spec,
    mode: str,
    findings: list[dict[str, Any]],
    onset_s: float,
    ends: list[tuple[int, float]],
) -> Score:
    # One finding per id (a resolved re-send of an open finding is the same finding).
    unique = list({f["finding_id"]: f for f in findings}.values())
    unique.sort(key=lambda f: f.get("detected_s") or 0.0)
    s = Score(spec, mode, unique)
    if spec.kind == "clean":
        return s
    naming = [f for f in unique if spec.rank in f["subjects"].get("ranks", [])]
    s.correct = sum(1 for f in naming if f["kind"] in ACCEPT[spec.kind] and _names(spec, f))
    if not naming:
        return s
    s.detected = True
    s.culprit_ok = _names(spec, unique[0])
    s.kind_ok = naming[0]["kind"] == spec.kind
    slow = [f for f in naming if f["kind"] in ("straggler", "data_stall")]
    s.want_shape = expected_shape(spec)
    if s.want_shape and slow:
        s.shape = said_shape(slow[0])
    detected = float(naming[0].get("detected_s") or 0.0)
    if detected and onset_s == onset_s:
        s.latency_s = round(detected - onset_s, 2)
        # Steps from the fault's first step to the first step that ended at detection.
        ended = [step for step, end in ends if end >= detected - 1e-3]
        last = max((step for step, _ in ends), default=spec.onset)
        s.latency_steps = max(0, (min(ended) if ended else last) - spec.onset)
    s.on_time = _on_time(spec, s, ends)
    return s


def _on_time(spec: Spec, s: Score, ends: list[tuple[int, float]]) -> bool:
    if not s.detected:
        return False
    if spec.kind in ("straggler", "data_stall") and spec.group != "noisy neighbour":
        return s.latency_steps is not None and s.latency_steps <= WITHIN_STEPS
    if spec.kind == "hang":
        times = [b - a for (_, a), (step, b) in itertools.pairwise(ends) if step <= spec.onset]
        budget = max(3 * statistics.median(times), HANG_BUDGET_S) if times else HANG_BUDGET_S
        return s.latency_s is not None and s.latency_s <= budget
    return True


def _names(spec: Spec, finding: dict[str, Any]) -> bool:
    """Whether the finding names the culprit alone (a slow link: the two ends of the link, the
    culprit's node among them)."""
    ranks = finding["subjects"].get("ranks", [])
    if spec.kind == "slow_link":
        nodes = finding["subjects"].get("nodes", [])
        return spec.rank in ranks and len(ranks) <= 2 and "host-b" in nodes
    return bool(ranks == [spec.rank])


def summarise(scores: list[Score]) -> dict[str, Any]:
    faults = [s for s in scores if s.spec.kind != "clean"]
    detected = [s for s in faults if s.detected]
    findings = sum(len(s.findings) for s in scores)
    correct = sum(s.correct for s in scores)
    lat = [s.latency_steps for s in detected if s.latency_steps is not None]
    lat_s = [s.latency_s for s in detected if s.latency_s is not None]
    clean = [s for s in scores if s.spec.kind == "clean"]
    false = sum(len(s.findings) for s in clean)
    clean_steps = sum(int(s.spec.case["steps"]) for s in clean)
    shaped = [s for s in detected if s.shape is not None]
    return {
        "cases": len(scores),
        "precision": round(correct / findings, 3) if findings else 1.0,
        "recall": round(len(detected) / len(faults), 3) if faults else 1.0,
        # Of the faults, the share detected within the deadline (`Score.on_time`).
        "recall_on_time": round(sum(s.on_time for s in faults) / len(faults), 3) if faults else 1.0,
        "culprit_accuracy": round(sum(s.culprit_ok for s in detected) / len(detected), 3)
        if detected
        else 0.0,
        "kind_accuracy": round(sum(s.kind_ok for s in detected) / len(detected), 3)
        if detected
        else 0.0,
        "clean_false_findings": false,
        # Steps of clean jobs analysed (each job once per mode), and false findings per 10,000.
        "clean_steps": clean_steps,
        "false_findings_per_10k_steps": round(false * 1e4 / clean_steps, 2)
        if clean_steps
        else None,
        "median_latency_steps": statistics.median(lat) if lat else None,
        "median_latency_s": round(statistics.median(lat_s), 2) if lat_s else None,
        "max_latency_s": max(lat_s) if lat_s else None,
        # Of the stragglers and stalls found, the share whose finding said the fault's shape.
        "shape_accuracy": round(sum(s.shape == s.want_shape for s in shaped) / len(shaped), 3)
        if shaped
        else None,
    }


def _line(label: str, summary: dict[str, Any]) -> str:
    keys = ("cases", "precision", "recall", "recall_on_time", "culprit_accuracy",
            "kind_accuracy", "clean_false_findings", "median_latency_steps",
            "median_latency_s")  # fmt: skip
    return f"{label:<38} " + "  ".join(f"{k}={summary[k]}" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrappers", default=",".join(WRAPPERS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1.25x forward, data, hang, clean")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--relay",
        action="store_true",
        help="ranks ship through their node's relay (ranks 0-1 and 2-3 as two nodes, as `vigil "
        "agent --relay-port` runs it), not straight to the collector (not the slow link's job)",
    )
    parser.add_argument(
        "--long",
        type=int,
        default=0,
        metavar="STEPS",
        help="only fault-free jobs of STEPS steps each (false alarms over long runs; not the "
        "slow link's job)",
    )
    args = parser.parse_args()
    if args.long and args.long <= STEPS:
        parser.error(f"--long {args.long}: give more steps than the matrix's own {STEPS}")
    wrappers = [w for w in args.wrappers.split(",") if w]
    if args.long:
        wrappers = [w for w in wrappers if w != "fsdp_tp"]
    unknown = set(wrappers) - set(WRAPPERS)
    if unknown:
        parser.error(f"unknown wrappers {sorted(unknown)}; choose from {WRAPPERS}")
    work = Path(tempfile.mkdtemp(prefix="vigil-faults-"))
    started = time.monotonic()
    collector = Collector(work)
    relays = [relay.RelayServer(collector.url) for _ in range(2)] if args.relay else []
    ships_to = {rank: relays[rank // 2].url for rank in range(4) if relays}
    specs: list[Spec] = []
    try:
        for wrapper in wrappers:
            grouped, alone = (
                (clean_specs(wrapper, args.seeds, args.long), [])
                if args.long
                else specs_for(wrapper, args.seeds, args.quick)
            )
            if wrapper == "fsdp_tp":
                specs.extend(run_slow_link(work, args.seeds))
                continue
            for batch in [grouped, *([c] for c in alone)]:
                result = launcher.launch(
                    wrapper, [s.case for s in batch], work / "out", collector=collector.url,
                    rank_collector=ships_to, progress_dir=work / "pages",
                    timeout_s=900 + args.long // 10,
                )  # fmt: skip
                expect_fail = any(s.kind == "crash" for s in batch)
                if (max(result.exit_codes) != 0) != expect_fail:
                    print(f"{wrapper}: launch exit codes {result.exit_codes}; see {result.logs}")
                print(f"{wrapper}: {len(batch)} case(s) in {result.seconds:.0f} s", flush=True)
                specs.extend(batch)
        time.sleep(3.0)  # the last flushes and the analyzer's queue
        # Every job has ended: the offline analyses (one `vigil analyze` each) run two at a time.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            offline = list(pool.map(offline_findings, [work / "out" / s.job for s in specs]))
        scores: list[Score] = []
        for spec, found in zip(specs, offline, strict=True):
            folder = work / "out" / spec.job
            onset, ends = step_times(folder, spec)
            scores.append(score(spec, "offline", found, onset, ends))
            online = (
                spec.online if spec.online is not None else online_findings(collector, spec.job)
            )
            scores.append(score(spec, "online", online, onset, ends))
    finally:
        for r in relays:
            r.close()
        collector.stop()
    relayed: dict[str, Any] = {}
    if relays:
        frames, requests = (
            sum(r.stats.frames for r in relays),
            sum(r.stats.requests for r in relays),
        )
        print(f"relays: {frames} batches in {requests} requests to the collector")
        relayed = {"relayed_batches": frames, "relay_requests": requests}
    report(scores)
    overall = summarise(scores)
    by_mode = {m: summarise([s for s in scores if s.mode == m]) for m in ("offline", "online")}
    targeted = {
        "straggler>=1.25x": summarise(
            [s for s in scores if s.spec.group in ("straggler 1.25x", "straggler 2.0x")]
        ),
        "hang": summarise([s for s in scores if s.spec.kind == "hang"]),
        "straggler 1.1x": summarise([s for s in scores if s.spec.group == "straggler 1.1x"]),
    }
    for name, summary in targeted.items():
        print(_line(f"target {name}", summary))
    print(f"matrix ran in {time.monotonic() - started:.0f} s; work folder {work}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({**overall, **relayed, "by_mode": by_mode, "targets": targeted}))


def report(scores: list[Score]) -> None:
    print("\nper case (offline | online): detected culprit kind latency_steps latency_s findings")
    pairs: dict[str, list[Score]] = defaultdict(list)
    for s in scores:
        pairs[s.spec.job].append(s)
    for job, both in pairs.items():
        cells = []
        for s in both:
            kinds = ",".join(f"{f['kind']}:{f['subjects'].get('ranks', [])}" for f in s.findings)
            cells.append(
                f"{'Y' if s.detected else '-'}{'c' if s.culprit_ok else ' '}"
                f"{'k' if s.kind_ok else ' '} {s.latency_steps!s:>4} {s.latency_s!s:>6} [{kinds}]"
            )
        print(f"  {job:<34} " + " | ".join(cells))
    wrong = [(s, f) for s in scores if s.spec.kind == "clean" for f in s.findings]
    if wrong:  # what a false alarm said, so that its cause can be read from this log
        print("\nfindings on clean jobs:")
        for s, f in wrong:
            evidence = "; ".join(
                f"{e['metric']} {e['observed']:.4g} vs {e.get('baseline')}" for e in f["evidence"]
            )
            print(f"  {s.spec.job} ({s.mode}): {f['summary']} [{evidence}]")
    print()
    groups: dict[str, list[Score]] = defaultdict(list)
    wrappers: dict[str, list[Score]] = defaultdict(list)
    for s in scores:
        groups[s.spec.group].append(s)
        wrappers[s.spec.wrapper].append(s)
    for name, items in groups.items():
        print(_line(f"kind {name}", summarise(items)))
    for name, items in wrappers.items():
        print(_line(f"wrapper {name}", summarise(items)))
    said: dict[tuple[str, str], int] = defaultdict(int)
    for s in scores:
        if s.want_shape and s.shape:
            said[(s.want_shape, s.shape)] += 1
    print("shape (fault: what its finding said):", ", ".join(
        f"{want}: {n} {got}" for (want, got), n in sorted(said.items())))  # fmt: skip


if __name__ == "__main__":
    main()
