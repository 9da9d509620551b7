"""Step-time cost of vigil's trainer integrations: Hugging Face Trainer and Lightning.

    python bench/integrations.py            # 24 rounds per framework, ~8 minutes on 2 cores
    python bench/integrations.py --quick    # 2 rounds of 8-step blocks, a smoke run (~1.5 minutes)

Each framework's user-style job (`tests/integrations/hf_job.py`, `lightning_job.py`: a tiny
GPT-2-shaped model from a config, synthetic tokens) runs ONCE on 2 gloo CPU ranks (one per
core), launched the way torchrun does, and trains many short blocks in turn inside that one
process group (`--cases`): each block is a fresh Trainer (`trainer.train()` / `trainer.fit()`)
of a fresh model with the same seed (the same weights, data and DDP buckets), of one of three
modes:
  - `vigil`: with the integration's `VigilCallback`, doing what a user's vigil run does: the
    SDK session started by the callback (step records with tokens and loss, phases, DDP's
    all-reduce timed through the SDK's comm hook, the checkpoint agreement), its records
    written to a local output folder (no collector), its progress page in /dev/shm as by
    default, shut down at the block's end;
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

Beside the wall ratios, the same ratio of the process's CPU seconds per step (all threads:
vigil's background and agreement threads and gloo's included; on a 2-core machine with one
rank per core, extra CPU anywhere in the process is step time) with its A/A control. Then
one more launch per framework, vigil only (`--sampled-steps`), with py-spy sampling rank 0's
training thread (wall clock, idle included): the share of its training loop's samples inside
vigil's own code (callback, SDK), apart from the collectives and DDP bucket work that vigil's
wrappers pass on to torch (done with or without vigil). Machine noise stretches samples in and
out of vigil alike, so this resolves far below the ratios' noise on a busy machine; it misses
the other threads and indirect costs (caches), which the CPU ratio sees.

And, far less sensitive to what else the machine runs: the share of rank 0's process CPU
over a block's steps after `--skip` that the threads the block started took (read by the job
at those steps' ends): in a vigil block vigil's background threads (record flusher, checkpoint
agreement and gloo's threads for its group), in a plain block none (its control, 0).

Target: hf_overhead_ratio and lightning_overhead_ratio <= 1.02.
Last line: one JSON object: hf_overhead_ratio, lightning_overhead_ratio, their `_90` intervals,
`<fw>_aa_ratio` (the A/A control) and its `_90`, `<fw>_cpu_ratio` (and `_90`),
`<fw>_cpu_aa_ratio`, `<fw>_plain_step_ms`, `<fw>_vigil_threads_cpu_pct` and
`<fw>_plain_threads_cpu_pct` (the started threads' share), `<fw>_vigil_thread_pct` (with
sampling), rounds,
steps (per block), skip and world.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import vigil
import vigil.agent
import vigil.integrations
from vigil.agent import ddp_hook

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
KINDS = ("wall", "cpu")
ORDERS = (("vigil", "plain", "plain_again"), ("plain_again", "plain", "vigil"))
WORLD = 2


def _plan(fw: str, rounds: int, rng: random.Random) -> list[tuple[int, str, str]]:
    """(round, mode, block name) in training order; round -1 is the discarded warm-up."""
    plan = []
    for r in range(-1, rounds):
        for mode in ORDERS[rng.randrange(2)]:
            plan.append((r, mode, f"{fw}-{'warmup' if r < 0 else f'r{r:02d}'}-{mode}"))
    return plan


def _case(fw: str, name: str, mode: str, steps: int, skip: int = 0) -> dict[str, Any]:
    case: dict[str, Any] = {"job": name, "steps": steps, "vigil": mode == "vigil"}
    case["threads_from"] = skip
    if fw == "hf":
        case["grad_accum"] = 2
    return case


def _launch(
    fw: str, cases: list[dict[str, Any]], out: Path, timeout_s: float, *, spy: Path | None = None
) -> None:
    """Run the framework's job on WORLD ranks, all `cases` in turn in one process group;
    `spy`: py-spy samples rank 0 into this file (raw format) while it runs."""
    out.mkdir(parents=True)
    # Progress pages where vigil puts them by default: in memory (/dev/shm), not on disk.
    shm = Path("/dev/shm")
    pages = (
        Path(tempfile.mkdtemp(prefix="vigil-bench-", dir=shm)) if shm.is_dir() else out / "pages"
    )
    try:
        _run_ranks(fw, cases, out, pages, timeout_s, spy)
    finally:
        shutil.rmtree(pages, ignore_errors=True)


def _run_ranks(
    fw: str, cases: list[dict[str, Any]], out: Path, pages: Path, timeout_s: float, spy: Path | None
) -> None:
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
            "VIGIL_PROGRESS_DIR": str(pages),
        }
        for name in ("VIGIL_COLLECTOR_URL", "VIGIL_OUTPUT_DIR", "VIGIL_JOB"):
            env.pop(name, None)
        command = [sys.executable, str(JOBS[fw]), "--out", str(out), "--cases", str(spec)]
        command += WORKLOADS[fw]
        log = (out / f"rank-{rank}.log").open("wb")
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    sampler = _spy(procs[0].pid, spy) if spy is not None else None
    deadline = time.monotonic() + timeout_s
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as exc:
            for p in procs:
                p.kill()
            raise SystemExit(f"{fw} job ran past {timeout_s:.0f} s; logs in {out}") from exc
    if sampler is not None:
        _, err = sampler.communicate(timeout=120)  # py-spy ends with the process it samples
        if spy is not None and not spy.is_file():
            raise SystemExit(f"py-spy wrote no samples: {err.decode(errors='replace')[-500:]}")
    if any(codes):
        tail = (out / "rank-0.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{fw} job exited {codes}; rank 0 log:\n{tail}")


def _spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit(
            "py-spy is not installed (it comes with the dev extra); or --sampled-steps 0"
        )
    time.sleep(1.0)  # the interpreter is up (the job's imports alone take seconds)
    cmd = [spy, "record", "--pid", str(pid), "--rate", "250", "--idle", "--nonblocking"]
    cmd += ["--threads", "--full-filenames", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


# The frame every sample of a training loop's steps has (start-up, set-up and the end have not):
# Trainer's loop over an epoch's steps, Lightning's epoch loop.
TRAINING_LOOP = {"hf": "Trainer._run_epoch", "lightning": "_TrainingEpochLoop.run"}
# vigil frames that hand over to work the job does without vigil too: the collective a patched
# torch.distributed function or Work.wait runs, DDP's own bucket division and all-reduce start.
PASS_THROUGH = {"_wrap.<locals>.wrapper", "_wrap_wait.<locals>.wait", *ddp_hook.DDP_BUCKET_WORK}


def _vigil_share(fw: str, raw: Path) -> tuple[float, float, int]:
    """(% of rank 0's training-thread samples inside its training loop spent in vigil's own code,
    % in collectives and DDP bucket work reached through vigil's wrappers, samples)."""
    ours = tuple(
        os.path.dirname(m.__file__ or "") + os.sep for m in (vigil, vigil.agent, vigil.integrations)
    )
    total = own = through = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames[0].endswith("MainThread") or not any(
            f.startswith(TRAINING_LOOP[fw] + " (") for f in frames
        ):
            continue
        total += int(count)
        mine = [f for f in frames[1:] if f.rpartition(" (")[2].startswith(ours)]
        if mine:
            if mine[-1].partition(" (")[0] in PASS_THROUGH:
                through += int(count)
            else:
                own += int(count)
    if not total:
        raise SystemExit(f"py-spy sampled no {fw} training loop in {raw}")
    return 100.0 * own / total, 100.0 * through / total, total


def _block_times(fw: str, out: Path, name: str, steps: int) -> tuple[list[float], list[float]]:
    """Rank 0's per-step wall seconds of one block, as the job's own timer measured them, and
    its process's CPU seconds (all threads) over each."""
    if fw == "hf":
        own = json.loads((out / name / "job.rank0.json").read_text())
        times = [float(s["interval"]) for s in own["steps"]]
        cpu = [float(s["cpu"]) for s in own["steps"]]
    else:
        times = [float(t) for t in json.loads((out / name / "step_times.rank0.json").read_text())]
        cpu = [float(t) for t in json.loads((out / name / "step_cpu.rank0.json").read_text())]
    if len(times) != steps or len(cpu) != steps:
        raise SystemExit(f"{fw} block {name} timed {len(times)} steps, expected {steps}")
    return times, cpu


def _threads_share(out: Path, name: str, cpu: list[float], skip: int) -> float:
    """% of rank 0's process CPU over a block's steps after its first `skip` taken by the
    threads the block started: in a vigil block vigil's (the record flusher, the checkpoint
    agreement's thread, gloo's threads for the agreement's group), in a plain one none."""
    own = json.loads((out / name / "job.rank0.json").read_text())
    used = float(own["new_threads_cpu"]) - float(own["new_threads_cpu_from"])
    return 100.0 * used / max(sum(cpu[skip:]), 1e-9)


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
) -> dict[str, dict[str, list[float]]]:
    """Per-round block medians (seconds) of each mode, wall ("wall") and CPU ("cpu"), from one
    launch of the framework's job."""
    plan = _plan(fw, args.rounds, order_rng)
    out = tmp / fw
    started = time.monotonic()
    cases = [_case(fw, name, mode, args.steps, args.skip) for _, mode, name in plan]
    _launch(fw, cases, out, args.timeout)
    print(f"{fw}: {len(plan)} blocks of {args.steps} steps in {time.monotonic() - started:.0f} s")
    medians: dict[str, dict[str, list[float]]] = {
        k: {m: [] for m in MODES} for k in (*KINDS, "threads")
    }
    for r, mode, name in plan:
        times, cpu = _block_times(fw, out, name, args.steps)
        if mode == "vigil" and (recorded := _vigil_steps(fw, out, name)) != args.steps:
            message = f"{fw} block {name}: {recorded} vigil step records for {args.steps} steps"
            raise SystemExit(message)
        if r >= 0:
            medians["wall"][mode].append(float(np.median(times[args.skip :])))
            medians["cpu"][mode].append(float(np.median(cpu[args.skip :])))
            medians["threads"][mode].append(_threads_share(out, name, cpu, args.skip))
    wall = medians["wall"]
    for r in range(args.rounds):
        base = wall["plain"][r]
        print(
            f"{fw} round {r}: plain {base * 1e3:.1f} ms/step, vigil "
            f"{wall['vigil'][r] / base:.4f}, A/A {wall['plain_again'][r] / base:.4f}; CPU vigil "
            f"{medians['cpu']['vigil'][r] / medians['cpu']['plain'][r]:.4f}",
            flush=True,
        )
    return medians


def _ratios(
    medians: dict[str, list[float]], rng: np.random.Generator
) -> tuple[float, list[float], float, list[float]]:
    """Median per-round vigil/plain and plain_again/plain ratios with bootstrap 90 % intervals."""
    plain = np.asarray(medians["plain"])
    ratio, ratio_90 = _median_interval(list(np.asarray(medians["vigil"]) / plain), rng)
    aa, aa_90 = _median_interval(list(np.asarray(medians["plain_again"]) / plain), rng)
    return ratio, ratio_90, aa, aa_90


def _report(
    fw: str, medians: dict[str, dict[str, list[float]]], rng: np.random.Generator
) -> dict[str, object]:
    """Print one framework's ratios; its keys of the last line."""
    ratio, ratio_90, aa, aa_90 = _ratios(medians["wall"], rng)
    cpu, cpu_90, cpu_aa, _ = _ratios(medians["cpu"], rng)
    plain_ms = float(np.median(medians["wall"]["plain"])) * 1e3
    print(
        f"{fw}: overhead ratio {ratio:.4f} (90% interval {ratio_90[0]:.4f}-"
        f"{ratio_90[1]:.4f}), A/A {aa:.4f} ({aa_90[0]:.4f}-{aa_90[1]:.4f}), "
        f"plain step {plain_ms:.1f} ms; CPU per step {cpu:.4f} ({cpu_90[0]:.4f}-"
        f"{cpu_90[1]:.4f}), its A/A {cpu_aa:.4f}",
        flush=True,
    )
    figures = {
        "overhead_ratio": ratio,
        "overhead_ratio_90": ratio_90,
        "aa_ratio": aa,
        "aa_ratio_90": aa_90,
        "cpu_ratio": cpu,
        "cpu_ratio_90": cpu_90,
        "cpu_aa_ratio": cpu_aa,
    }
    result: dict[str, object] = {
        f"{fw}_{key}": [round(v, 4) for v in value] if isinstance(value, list) else round(value, 4)
        for key, value in figures.items()
    }
    result[f"{fw}_plain_step_ms"] = round(plain_ms, 2)
    threads = {mode: float(np.median(medians["threads"][mode])) for mode in ("vigil", "plain")}
    print(
        f"{fw}: threads a block started took {threads['vigil']:.2f}% of its CPU with vigil, "
        f"{threads['plain']:.2f}% without (median over rounds)",
        flush=True,
    )
    result[f"{fw}_vigil_threads_cpu_pct"] = round(threads["vigil"], 3)
    result[f"{fw}_plain_threads_cpu_pct"] = round(threads["plain"], 3)
    return result


def _sampled(fw: str, args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    """One more launch, vigil only, `--sampled-steps` steps, rank 0 sampled by py-spy."""
    out = tmp / f"{fw}-sampled"
    case = _case(fw, f"{fw}-sampled", "vigil", args.sampled_steps)
    _launch(fw, [case], out, args.timeout, spy=out.with_suffix(".spy"))
    own, through, samples = _vigil_share(fw, out.with_suffix(".spy"))
    where = f"{samples} py-spy samples of rank 0's training loop, {args.sampled_steps} steps"
    print(f"{fw}: {own:.2f}% of the training thread's wall time in vigil's own code ({where}),")
    print(f"  {through:.2f}% in collectives and DDP bucket work passed on by vigil", flush=True)
    return {f"{fw}_vigil_thread_pct": round(own, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per block")
    parser.add_argument("--skip", type=int, default=2, help="first steps of a block not counted")
    parser.add_argument("--frameworks", default="hf,lightning")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sampled-steps", type=int, default=80, help="steps of the py-spy sampled run (0: none)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the jobs' files in this (new) folder")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.sampled_steps = 2, 8, 12
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
            result.update(_report(fw, medians, boot_rng))
            if args.sampled_steps:
                result.update(_sampled(fw, args, args.keep or Path(tmp)))
    result["rounds"], result["steps"], result["skip"] = args.rounds, args.steps, args.skip
    result["world"] = WORLD
    print(json.dumps(result))


if __name__ == "__main__":
    main()
