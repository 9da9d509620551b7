"""Recovery from a crash and from a hang: vigil's controller beside `torchrun --max-restarts`.

The same job runs four ways in one go — the bundled trainer (tiny recipe, 2 data-parallel gloo
ranks on 2 simulated nodes, SDK shipping to a local collector, a persistent checkpoint every 5
steps):
  1. under `vigil run`'s controller with a crash injected at step K (rank 1);
  2. the same with a hang injected at step K (rank 1 stops before its collectives);
  3. under `torchrun --max-restarts 1` with the same crash (its restart resumes from the periodic
     checkpoint; vigil's from the per-step in-memory snapshot);
  4. a bare start of the job resuming from its newest checkpoint (process start + state load +
     one step), the yardstick for restart time.
Detection time is from the fault's onset (the end of step K-1) to the finding; restart time from
the controller's decision to the first completed step; steps lost = completed steps redone.
The last line is one JSON object with the issue's keys.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vigil.recovery import collector_link, demo, journal
from vigil.recovery.demo_report import read_steps
from vigil.recovery.policy import RESTARTING
from vigil.schema import FindingKind

FAULT_STEP, STEPS, CKPT_EVERY = 8, 14, 5


def job_spec(job: str, url: str, workdir: Path, faults: str, steps: int = STEPS) -> demo.TrainJob:
    return demo.TrainJob(
        job=job, url=url, workdir=workdir, steps=steps, faults=faults, nproc=2, nodes=2,
        spare=0, layout=("--dp", "2"), ckpt_every=CKPT_EVERY,
    )  # fmt: skip


def onset(steps: list[dict[str, Any]], attempt: int = 0) -> float:
    return min(s["end_s"] for s in steps if s["attempt"] == attempt and s["step"] == FAULT_STEP - 1)


def first_of(steps: list[dict[str, Any]], attempt: int) -> dict[str, Any]:
    return min((s for s in steps if s["attempt"] == attempt), key=lambda s: s["end_s"])


def vigil_case(kind: str, url: str, root: Path) -> dict[str, float]:
    workdir = root / f"vigil-{kind}"
    workdir.mkdir()
    job = f"bench-{kind}-{int(time.time())}"
    where = ",where=before" if kind == "hang" else ""
    code = demo.supervise(job_spec(job, url, workdir, f"{kind}:rank=1,step={FAULT_STEP}{where}"))
    if code != 0:
        raise RuntimeError(f"vigil {kind} run failed (exit {code}); see {workdir}")
    time.sleep(1.0)
    steps = read_steps(workdir / "steps.jsonl")
    actions = journal.Journal(workdir / "controller").actions()
    restart = min((a for a in actions if a.kind in RESTARTING), key=lambda a: a.start_s)
    wanted = FindingKind.CRASH if kind == "crash" else FindingKind.HANG
    found = collector_link.CollectorFindings(url=url, job_id=job).fetch()
    finding = next(f for f in found if f.finding_id == restart.finding_id and f.kind is wanted)
    began = onset(steps)
    first = first_of(steps, 1)
    return {
        "detect_s": finding.detected_s - began,
        "restart_s": first["end_s"] - restart.start_s,
        "recover_s": first["end_s"] - began,
        "steps_lost": max(0, (FAULT_STEP - 1) - (first["step"] - 1)),
        "culprit_ok": float(finding.subjects.ranks == [1]),
    }


def bare_case(url: str, root: Path, source: Path) -> float:
    """Start the job from its newest committed checkpoint and train one step."""
    workdir = root / "bare"
    workdir.mkdir()
    shutil.copytree(source / "checkpoints", workdir / "checkpoints")
    done = max(s["step"] for s in read_steps(source / "steps.jsonl"))
    job = f"bench-bare-{int(time.time())}"
    code = demo.supervise(job_spec(job, url, workdir, "", steps=done + 1))
    if code != 0:
        raise RuntimeError(f"bare start failed (exit {code}); see {workdir}")
    started = journal.Journal(workdir / "controller").load_state()
    assert started is not None
    return first_of(read_steps(workdir / "steps.jsonl"), 0)["end_s"] - started.attempt_started_s


def torchrun_case(url: str, root: Path) -> dict[str, float]:
    workdir = root / "torchrun"
    workdir.mkdir()
    spec = job_spec(f"bench-torchrun-{int(time.time())}", url, workdir,
                    f"crash:rank=1,step={FAULT_STEP}")  # fmt: skip
    argv = spec.command()
    train_args = argv[argv.index("train") + 1 :]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.2", "-m", "vigil.trainer", *train_args],
        capture_output=True, text=True, timeout=600, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")},
    )  # fmt: skip
    (workdir / "torchrun.log").write_text(done.stdout + done.stderr)
    steps = read_steps(workdir / "steps.jsonl")
    after = [s for s in steps if s["attempt"] == 1]
    if done.returncode != 0 or not after:
        return {"recover_s": float("nan"), "steps_lost": float("nan")}
    first = first_of(steps, 1)
    return {
        "recover_s": first["end_s"] - onset(steps),
        "steps_lost": max(0, (FAULT_STEP - 1) - (first["step"] - 1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", type=Path, help="keep every run's files here")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="vigil-bench-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    with demo.platform(root) as url:
        crash = vigil_case("crash", url, root)
        hang = vigil_case("hang", url, root)
        bare = bare_case(url, root, root / "vigil-crash")
        torchrun = torchrun_case(url, root)
    rows = [("vigil crash", crash), ("vigil hang", hang), ("torchrun crash", torchrun)]
    print(f"job: tiny trainer, 2 dp ranks (gloo), fault at step {FAULT_STEP}, "
          f"checkpoint every {CKPT_EVERY} steps; bare start+load+1 step: {bare:.2f} s")  # fmt: skip
    for name, row in rows:
        print(f"{name:15s} " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()))
    print(json.dumps({
        "crash_steps_lost": crash["steps_lost"],
        "hang_steps_lost": hang["steps_lost"],
        "crash_restart_ratio": round(crash["restart_s"] / bare, 3),
        "hang_restart_ratio": round(hang["restart_s"] / bare, 3),
        "crash_detect_s": round(crash["detect_s"], 2),
        "hang_detect_s": round(hang["detect_s"], 2),
        "torchrun_crash_steps_lost": torchrun["steps_lost"],
        "torchrun_crash_recover_s": round(torchrun["recover_s"], 2),
        "vigil_crash_recover_s": round(crash["recover_s"], 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
