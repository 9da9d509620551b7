"""Step-time cost of vigil's trainer integrations: Hugging Face Trainer and Lightning.

    python bench/integrations.py            # 24 rounds per framework, 7-10 minutes on 2 cores
    python bench/integrations.py --quick    # 2 rounds of 8-step blocks, a smoke run (~1 minute)

Each framework's user-style job (`tests/integrations/hf_job.py`, `lightning_job.py`: a tiny
GPT-2-shaped model from a config, synthetic tokens) runs ONCE on 2 gloo CPU ranks (one per
core), launched the way torchrun does, and trains many short blocks in turn inside that one
process group (`--cases`): each block is a fresh Trainer (`trainer.train()` / `trainer.fit()`)
of a fresh model with the same seed (the same weights, data and DDP buckets), of one of three
modes:
  - `vigil`: with the integration's `VigilCallback`, doing what a user's vigil run does: the
    SDK session started by the callback (step records with tokens and loss, phases, DDP's
    all-reduce timed through the SDK's comm hook, the checkpoint agreement), its records
    written to a local output folder (no collector), shut down at the block's end;
  - `plain`: the identical training without the callback (not in the callback list: no hook,
    no comm hook, no patched collectives; vigil's shutdown restores all of them);
  - `plain_again`: plain once more, the A/A control: its ratio to plain is this method's noise.
A round is three adjacent blocks, `vigil plain plain_again` or `plain_again plain vigil` (a
seeded coin per round), so both ratios compare neighbouring blocks, at the same distance, and
drift over a round hits the vigil and the A/A ratio alike. One warm-up round runs first and is
discarded (imports, allocator, caches). Every job times each optimizer step with a plain
callback of its own, independent of vigil, from the previous step's end to this one's (so
vigil's hooks at both ends of a step, and between steps, count); a block's step time is the
median over rank 0's steps after its first `--skip` (the fresh model's and DDP's first steps).
A round's ratio is its vigil (or plain_again) block's median over its plain block's; the
figures are the median of the per-round ratios with a bootstrap 90 % interval over rounds.
Every vigil block's records are checked: one step record per optimizer step.

Target: hf_overhead_ratio and lightning_overhead_ratio <= 1.02.
Last line: one JSON object: hf_overhead_ratio, lightning_overhead_ratio, their `_90` intervals,
`<fw>_aa_ratio` (the A/A control) and its `_90`, `<fw>_plain_step_ms`, rounds, steps (per
block), skip and world.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
JOBS = {
    "hf": ROOT / "tests" / "integrations" / "hf_job.py",
    "lightning": ROOT / "tests" / "integrations" / "lightning_job.py",
}
# The model and batch each job trains here: steps of roughly 100-250 ms on 2 CPU ranks, the
# scale of real per-step work relative to the SDK's fixed per-step cost (a 20 ms toy step would
# measure the toy, not the integration).
WORKLOADS = {
    "hf": ["--hidden", "256", "--layers", "4", "--grad-accum", "2"],
    "lightning": ["--batch", "64", "--accumulate", "2"],
}
MODES = ("vigil", "plain", "plain_again")
ORDERS = (("vigil", "plain", "plain_again"), ("plain_again", "plain", "vigil"))
WORLD = 2


def _plan(fw: str, rounds: int, rng: random.Random) -> list[tuple[int, str, str]]:
    """(round, mode, block name) in training order; round -1 is the discarded warm-up."""
    plan = []
    for r in range(-1, rounds):
        for mode in ORDERS[rng.randrange(2)]:
            plan.append((r, mode, f"{fw}-{'warmup' if r < 0 else f'r{r:02d}'}-{mode}"))
    return plan


def _case(fw: str, name: str, mode: str, steps: int) -> dict[str, Any]:
    case: dict[str, Any] = {"job": name, "steps": steps, "vigil": mode == "vigil"}
    if fw == "hf":
        case["grad_accum"] = 2
    return case


def _launch(fw: str, cases: list[dict[str, Any]], out: Path, timeout_s: float) -> None:
    """Run the framework's job on WORLD ranks, all `cases` in turn in one process group."""
    out.mkdir(parents=True)
    spec = out / "cases.json"
    spec.write_text(json.dumps(cases))
    from vigil.recovery.local import free_port

    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "VIGIL_PROGRESS_DIR": str(out / "progress"),
        }
        for name in ("VIGIL_COLLECTOR_URL", "VIGIL_OUTPUT_DIR", "VIGIL_JOB"):
            env.pop(name, None)
        command = [sys.executable, str(JOBS[fw]), "--out", str(out), "--cases", str(spec)]
        command += WORKLOADS[fw]
        log = (out / f"rank-{rank}.log").open("wb")
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as exc:
            for p in procs:
                p.kill()
            raise SystemExit(f"{fw} job ran past {timeout_s:.0f} s; logs in {out}") from exc
    if any(codes):
        tail = (out / "rank-0.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{fw} job exited {codes}; rank 0 log:\n{tail}")


def _block_times(fw: str, out: Path, name: str, steps: int) -> list[float]:
    """Rank 0's per-step wall seconds of one block, as the job's own timer measured them."""
    if fw == "hf":
        own = json.loads((out / name / "job.rank0.json").read_text())
        times = [float(s["interval"]) for s in own["steps"]]
    else:
        times = [float(t) for t in json.loads((out / name / "step_times.rank0.json").read_text())]
    if len(times) != steps:
        raise SystemExit(f"{fw} block {name} timed {len(times)} steps, expected {steps}")
    return times


def _vigil_steps(fw: str, out: Path, name: str) -> int:
    """Step records rank 0's vigil session wrote for one block (proof that vigil ran)."""
    folder = out / "vigil" / name if fw == "hf" else out / name
    path = folder / "rank-00000.jsonl"
    if not path.is_file():
        raise SystemExit(f"{fw} block {name} ran with vigil but wrote no records at {path}")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(1 for r in records if r.get("type") == "step")


def _median_interval(values: list[float], rng: np.random.Generator) -> tuple[float, list[float]]:
    data = np.asarray(values)
    boots = np.median(rng.choice(data, size=(2000, data.size), replace=True), axis=1)
    return float(np.median(data)), [float(np.percentile(boots, 5)), float(np.percentile(boots, 95))]


def _bench(
    fw: str, args: argparse.Namespace, tmp: Path, order_rng: random.Random
) -> dict[str, list[float]]:
    """Per-round block medians (seconds) of each mode, from one launch of the framework's job."""
    plan = _plan(fw, args.rounds, order_rng)
    out = tmp / fw
    started = time.monotonic()
    _launch(fw, [_case(fw, name, mode, args.steps) for _, mode, name in plan], out, args.timeout)
    print(f"{fw}: {len(plan)} blocks of {args.steps} steps in {time.monotonic() - started:.0f} s")
    medians: dict[str, list[float]] = {m: [] for m in MODES}
    for r, mode, name in plan:
        times = _block_times(fw, out, name, args.steps)
        if mode == "vigil" and (recorded := _vigil_steps(fw, out, name)) != args.steps:
            raise SystemExit(
                f"{fw} block {name}: {recorded} vigil step records, {args.steps} steps"
            )
        if r >= 0:
            medians[mode].append(float(np.median(times[args.skip :])))
    for r in range(args.rounds):
        base = medians["plain"][r]
        print(
            f"{fw} round {r}: plain {base * 1e3:.1f} ms/step, vigil "
            f"{medians['vigil'][r] / base:.4f}, A/A {medians['plain_again'][r] / base:.4f}",
            flush=True,
        )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per block")
    parser.add_argument("--skip", type=int, default=2, help="first steps of a block not counted")
    parser.add_argument("--frameworks", default="hf,lightning")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the jobs' files in this (new) folder")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 8
    if args.rounds < 2 or args.steps <= args.skip or args.skip < 0:
        parser.error("need --rounds >= 2 and --steps > --skip >= 0")
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = [f for f in frameworks if f not in JOBS]
    if unknown:
        parser.error(f"unknown framework(s) {unknown}; choose from {sorted(JOBS)}")
    order_rng, boot_rng = random.Random(args.seed), np.random.default_rng(args.seed)
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="vigil-bench-integrations-") as tmp:
        for fw in frameworks:
            medians = _bench(fw, args, args.keep or Path(tmp), order_rng)
            plain = np.asarray(medians["plain"])
            ratio, ratio_90 = _median_interval(list(np.asarray(medians["vigil"]) / plain), boot_rng)
            aa, aa_90 = _median_interval(list(np.asarray(medians["plain_again"]) / plain), boot_rng)
            print(
                f"{fw}: overhead ratio {ratio:.4f} (90% interval {ratio_90[0]:.4f}-"
                f"{ratio_90[1]:.4f}), A/A {aa:.4f} ({aa_90[0]:.4f}-{aa_90[1]:.4f}), "
                f"plain step {float(np.median(plain)) * 1e3:.1f} ms",
                flush=True,
            )
            result[f"{fw}_overhead_ratio"] = round(ratio, 4)
            result[f"{fw}_overhead_ratio_90"] = [round(v, 4) for v in ratio_90]
            result[f"{fw}_aa_ratio"] = round(aa, 4)
            result[f"{fw}_aa_ratio_90"] = [round(v, 4) for v in aa_90]
            result[f"{fw}_plain_step_ms"] = round(float(np.median(plain)) * 1e3, 2)
    result["rounds"], result["steps"], result["skip"] = args.rounds, args.steps, args.skip
    result["world"] = WORLD
    print(json.dumps(result))


if __name__ == "__main__":
    main()
