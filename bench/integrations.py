"""Step-time cost of vigil's trainer integrations: Hugging Face Trainer and Lightning.

    python bench/integrations.py            # 6 rounds per framework, about 10 minutes on 2 cores
    python bench/integrations.py --quick    # 2 rounds, a smoke run

Each framework's user-style job (`tests/integrations/hf_job.py`, `lightning_job.py`: a tiny
GPT-2-shaped model from a config, synthetic tokens) runs on 2 gloo CPU ranks (one per core),
launched the way torchrun does. A round runs three launches of the same training in a shuffled
order (a new order each round, so machine drift hits every mode alike):
  - `vigil`: with the integration's callback (the SDK's step, phase and DDP collective timing,
    writing its records to a local output folder, as with no collector configured);
  - `plain`: the identical job without the callback (`--no-vigil`);
  - `plain_again`: plain once more, the A/A control: its ratio to plain is this machine's noise.
Every job times each optimizer step with a plain framework callback of its own, independent of
vigil (`step_times.rank<R>.json`); a launch's step time is the median over rank 0's steps after
the first `--skip` (start-up, allocator warm-up). A round's ratio is its vigil (or plain_again)
median over its plain median; the figures are the median of per-round ratios with a bootstrap
90 % interval over rounds.

Target: hf_overhead_ratio and lightning_overhead_ratio <= 1.02.
Last line: one JSON object: hf_overhead_ratio, lightning_overhead_ratio, their `_90` intervals,
`<fw>_aa_ratio` (the A/A control), `<fw>_plain_step_ms`, rounds and steps.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
JOBS = {
    "hf": ROOT / "tests" / "integrations" / "hf_job.py",
    "lightning": ROOT / "tests" / "integrations" / "lightning_job.py",
}
# The model and batch each job trains here: steps of roughly 100-200 ms on 2 CPU ranks, the
# scale of real per-step work relative to the SDK's fixed per-step cost (a 20 ms toy step would
# measure the toy, not the integration).
WORKLOADS = {
    "hf": ["--hidden", "256", "--layers", "4", "--grad-accum", "2"],
    "lightning": ["--batch", "64", "--accumulate", "2"],
}
MODES = ("vigil", "plain", "plain_again")
WORLD = 2


def _free_port() -> int:
    from vigil.recovery.local import free_port

    return free_port()


def _launch(script: Path, mode: str, steps: int, out: Path, timeout_s: float) -> list[float]:
    """Run `script` on WORLD ranks; rank 0's per-step wall seconds."""
    out.mkdir(parents=True)
    port = _free_port()
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
            "VIGIL_JOB": f"bench-integrations-{script.stem}",
            "VIGIL_OUTPUT_DIR": str(out / "vigil"),
            "VIGIL_PROGRESS_DIR": str(out / "progress"),
        }
        env.pop("VIGIL_COLLECTOR_URL", None)
        command = [sys.executable, str(script), "--steps", str(steps), "--out", str(out)]
        command += WORKLOADS[script.stem.removesuffix("_job")]
        if mode != "vigil":
            command.append("--no-vigil")
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
            message = f"{script.name} ({mode}) ran past {timeout_s:.0f} s; logs in {out}"
            raise SystemExit(message) from exc
    if any(codes):
        tail = (out / "rank-0.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{script.name} ({mode}) exited {codes}; rank 0 log:\n{tail}")
    times = json.loads((out / "step_times.rank0.json").read_text())
    if len(times) != steps:
        raise SystemExit(f"{script.name} ({mode}) timed {len(times)} steps, expected {steps}")
    return [float(t) for t in times]


def _median_interval(values: list[float], rng: np.random.Generator) -> tuple[float, list[float]]:
    data = np.asarray(values)
    boots = np.median(rng.choice(data, size=(2000, data.size), replace=True), axis=1)
    return float(np.median(data)), [float(np.percentile(boots, 5)), float(np.percentile(boots, 95))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--frameworks", default="hf,lightning")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 20
    if args.rounds < 1 or args.steps <= args.skip:
        parser.error("need --rounds >= 1 and --steps > --skip")
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = [f for f in frameworks if f not in JOBS]
    if unknown:
        parser.error(f"unknown framework(s) {unknown}; choose from {sorted(JOBS)}")
    order_rng, boot_rng = random.Random(args.seed), np.random.default_rng(args.seed)
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="vigil-bench-integrations-") as tmp:
        for fw in frameworks:
            medians: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.rounds):
                order = list(MODES)
                order_rng.shuffle(order)
                for mode in order:
                    out = Path(tmp) / fw / f"round-{r}-{mode}"
                    times = _launch(JOBS[fw], mode, args.steps, out, args.timeout)
                    medians[mode].append(float(np.median(times[args.skip :])))
                base = medians["plain"][-1]
                ratios = {m: medians[m][-1] / base for m in ("vigil", "plain_again")}
                print(
                    f"{fw} round {r}: plain {medians['plain'][-1] * 1e3:.1f} ms/step, "
                    f"vigil {ratios['vigil']:.4f}, A/A {ratios['plain_again']:.4f}",
                    flush=True,
                )
            plain = np.asarray(medians["plain"])
            ratio, ratio_90 = _median_interval(list(np.asarray(medians["vigil"]) / plain), boot_rng)
            aa, aa_90 = _median_interval(list(np.asarray(medians["plain_again"]) / plain), boot_rng)
            print(
                f"{fw}: overhead ratio {ratio:.4f} (90% interval {ratio_90[0]:.4f}-"
                f"{ratio_90[1]:.4f}), A/A {aa:.4f} ({aa_90[0]:.4f}-{aa_90[1]:.4f}), "
                f"plain step {float(np.median(plain)) * 1e3:.1f} ms"
            )
            result[f"{fw}_overhead_ratio"] = round(ratio, 4)
            result[f"{fw}_overhead_ratio_90"] = [round(v, 4) for v in ratio_90]
            result[f"{fw}_aa_ratio"] = round(aa, 4)
            result[f"{fw}_aa_ratio_90"] = [round(v, 4) for v in aa_90]
            result[f"{fw}_plain_step_ms"] = round(float(np.median(plain)) * 1e3, 2)
    result["rounds"], result["steps"], result["world"] = args.rounds, args.steps, WORLD
    print(json.dumps(result))


if __name__ == "__main__":
    main()
