"""Recovery from a crash and from a hang: vigil's controller beside `torchrun --max-restarts`.

The same job (the bundled trainer, tiny recipe, 2 data-parallel gloo ranks on 2 simulated nodes,
SDK shipping to a local collector, a persistent checkpoint every 5 steps) runs:
  1. under `vigil run`'s controller with a crash injected at step K (rank 1), for every K of one
     checkpoint interval (`--crash-steps`, default 6..10: just after a checkpoint to just before
     the next), since what a restart from a checkpoint loses depends on where in the interval
     the fault falls;
  2. the same with a hang injected at step 8 (rank 1 stops before its collectives);
  3. under `torchrun --max-restarts 1` with the same crashes (its restart resumes from the
     periodic checkpoint; vigil's from the per-step in-memory snapshot);
  4. under torchrun with the same hang. torchrun's elastic agent does not detect hangs: a user
     relies on the collective timeout, here gloo's process-group timeout (`--timeout`,
     `--torchrun-timeout` s, 60 by default: the same one vigil's runs are given; torch's own
     default is 1,800 s for gloo, 600 s for NCCL, where TORCH_NCCL_ASYNC_ERROR_HANDLING turns
     the timeout into the same crash), which makes the waiting rank raise, exit, and torchrun
     restart the group;
  5. a bare start of the job resuming from its newest checkpoint (process start + state load +
     one step), the yardstick for restart time;
  6. a user's own DDP loop with the documented snapshot calls (tests/realjobs/snapshot_job.py)
     under `vigil run --nproc 4 --nodes 2`: rank 1 SIGKILLed in the middle of step 6, then in the
     next attempt node-1's shared memory dropped and its rank 2 killed at step 10 (the peer's
     replica restores). Its steps lost come from the loop's own per-rank record of the steps it
     completed in each attempt (not from vigil): those every rank completed that the next
     attempt trained again.
Detection time is from the fault's onset (the end of step K-1) to the finding (torchrun: to the
first line of output saying a rank failed, stamped as it arrives); restart time from the
controller's decision to the first completed step; recovery from the onset to the first step
completed after the restart; steps lost = completed steps redone. The last line is one JSON
object: the keys before #21 keep their meaning (vigil's and torchrun's figures for the crash at
step 8, vigil's hang) and beside them the sweep's mean and worst steps lost for each, and
torchrun's hang figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from vigil.recovery import collector_link, demo, journal
from vigil.recovery.demo_report import read_steps
from vigil.recovery.policy import RESTARTING
from vigil.schema import FindingKind

FAULT_STEP, STEPS, CKPT_EVERY = 8, 14, 5
CRASH_STEPS = tuple(range(CKPT_EVERY + 1, 2 * CKPT_EVERY + 1))  # one checkpoint interval
# A rank's output saying it failed: the gloo timeout, a traceback, or torchrun's own verdict.
FAILED_LINE = re.compile(
    r"[Tt]imed out|Traceback|failed \(exitcode|Worker group (FAILED|UNHEALTHY)"
)


def job_spec(job: str, url: str, workdir: Path, faults: str, steps: int = STEPS) -> demo.TrainJob:
    return demo.TrainJob(
        job=job, url=url, workdir=workdir, steps=steps, faults=faults, nproc=2, nodes=2,
        spare=0, layout=("--dp", "2"), ckpt_every=CKPT_EVERY,
    )  # fmt: skip


def fault_spec(kind: str, step: int) -> str:
    return f"{kind}:rank=1,step={step}" + (",where=before" if kind == "hang" else "")


def last_done(steps: list[dict[str, Any]], fault_step: int, attempt: int = 0) -> dict[str, Any]:
    """The last step of `attempt` recorded before the fault (normally fault_step - 1; earlier
    when the record's rank was stopped before it recorded that step, which it then never
    finished)."""
    done = [s for s in steps if s["attempt"] == attempt and s["step"] < fault_step]
    return min(
        (s for s in done if s["step"] == max(x["step"] for x in done)), key=lambda s: s["end_s"]
    )


def onset(steps: list[dict[str, Any]], fault_step: int, attempt: int = 0) -> float:
    return float(last_done(steps, fault_step, attempt)["end_s"])


def first_of(steps: list[dict[str, Any]], attempt: int) -> dict[str, Any]:
    return min((s for s in steps if s["attempt"] == attempt), key=lambda s: s["end_s"])


def lost(steps: list[dict[str, Any]], fault_step: int, first: dict[str, Any]) -> int:
    """Completed steps redone: those finished before the fault that the restart ran again."""
    return max(0, int(last_done(steps, fault_step)["step"]) - (first["step"] - 1))


def vigil_case(kind: str, url: str, root: Path, step: int = FAULT_STEP) -> dict[str, float]:
    workdir = root / f"vigil-{kind}-{step}"
    workdir.mkdir()
    job = f"bench-{kind}-{step}-{int(time.time())}"
    code = demo.supervise(job_spec(job, url, workdir, fault_spec(kind, step)))
    if code != 0:
        raise RuntimeError(f"vigil {kind} run failed (exit {code}); see {workdir}")
    time.sleep(1.0)
    steps = read_steps(workdir / "steps.jsonl")
    actions = journal.Journal(workdir / "controller").actions()
    restart = min((a for a in actions if a.kind in RESTARTING), key=lambda a: a.start_s)
    wanted = FindingKind.CRASH if kind == "crash" else FindingKind.HANG
    found = [
        f for f in collector_link.CollectorFindings(url=url, job_id=job).fetch() if f.kind is wanted
    ]
    finding = next((f for f in found if f.finding_id == restart.finding_id), None)
    if finding is None:
        raise RuntimeError(f"job {job}: the collector holds no finding {restart.finding_id}")
    began = onset(steps, step)
    first = first_of(steps, 1)
    return {
        "detect_s": finding.detected_s - began,
        "restart_s": first["end_s"] - restart.start_s,
        "recover_s": first["end_s"] - began,
        "steps_lost": lost(steps, step, first),
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


def run_stamped(
    argv: list[str], env: dict[str, str], timeout_s: float
) -> tuple[int, list[tuple[float, str]]]:
    """Run `argv`; its exit code and every line of its output with the time it arrived."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    reader.join(timeout=10)
    return code, lines


def torchrun_case(kind: str, url: str, root: Path, step: int, timeout_s: float) -> dict[str, float]:
    workdir = root / f"torchrun-{kind}-{step}"
    workdir.mkdir()
    spec = job_spec(f"bench-torchrun-{kind}-{step}-{int(time.time())}", url, workdir,
                    fault_spec(kind, step))  # fmt: skip
    argv = spec.command()
    train_args = argv[argv.index("train") + 1 :]
    train_args[train_args.index("--timeout") + 1] = f"{timeout_s:g}"  # gloo's process-group timeout
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    code, lines = run_stamped(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.2", "-m", "vigil.trainer", *train_args],
        {**env, "PYTHONUNBUFFERED": "1"}, timeout_s=600 + timeout_s,
    )  # fmt: skip
    (workdir / "torchrun.log").write_text("".join(f"{t:.3f} {line}" for t, line in lines))
    steps = read_steps(workdir / "steps.jsonl")
    after = [s for s in steps if s["attempt"] == 1]
    if code != 0 or not after:
        nan = float("nan")
        return {"detect_s": nan, "recover_s": nan, "steps_lost": nan}
    began, first = onset(steps, step), first_of(steps, 1)
    failed = next((t for t, line in lines if t >= began and FAILED_LINE.search(line)), None)
    return {
        "detect_s": float("nan") if failed is None else failed - began,
        "recover_s": first["end_s"] - began,
        "steps_lost": lost(steps, step, first),
    }


USER_LOOP = Path(__file__).resolve().parents[1] / "tests" / "realjobs" / "snapshot_job.py"
USER_KILL_STEP, USER_DROP_STEP, USER_STEPS = 6, 10, 14


def user_loop_case(root: Path) -> dict[str, float]:
    """Steps lost by a user's loop to a SIGKILL and to a lost node's memory, from its record."""
    out = root / "user-loop"
    argv = [sys.executable, "-m", "vigil", "run", "--nproc", "4", "--nodes", "2",
            "--run-dir", str(root / "user-loop-run"), "--job", f"bench-user-{int(time.time())}",
            "--snapshot-dir", str(root / "user-loop-shm"), "--", sys.executable, str(USER_LOOP),
            "--out", str(out), "--steps", str(USER_STEPS), "--step-s", "0.1",
            f"--fault=0:1:{USER_KILL_STEP}:kill", f"--fault=1:2:{USER_DROP_STEP}:drop"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"user loop failed (exit {done.returncode}): {done.stderr[-2000:]}")
    rows = [
        [json.loads(line) for line in (out / f"steps-rank{r}.jsonl").read_text().splitlines()]
        for r in range(4)
    ]

    def lost_in(attempt: int) -> int:
        completed = min(max(x["step"] for x in rank if x["attempt"] == attempt) for rank in rows)
        resumed = min(x["step"] for rank in rows for x in rank if x["attempt"] == attempt + 1)
        return max(0, completed + 1 - resumed)

    return {"crash_steps_lost": lost_in(0), "node_loss_steps_lost": lost_in(1)}


def sweep_row(rows: dict[int, dict[str, float]]) -> dict[str, float]:
    """Mean and worst of a crash sweep's steps lost and recovery times."""
    lost_ = [r["steps_lost"] for r in rows.values()]
    recover = [r["recover_s"] for r in rows.values()]
    return {
        "steps_lost_mean": statistics.fmean(lost_),
        "steps_lost_max": max(lost_),
        "recover_s_mean": statistics.fmean(recover),
        "recover_s_max": max(recover),
    }


def _cells(row: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.2f}" for k, v in row.items())


def report(args: argparse.Namespace, bare: float, runs: dict[str, Any]) -> None:
    print(
        f"job: tiny trainer, 2 dp ranks (gloo), checkpoint every {CKPT_EVERY} steps; "
        f"bare start+load+1 step: {bare:.2f} s"
    )
    print(f"crash (rank 1) at each step of {args.crash_steps}: steps lost / recovery per step")
    for who in ("vigil", "torchrun"):
        cells = "  ".join(
            f"{k}:{r['steps_lost']:.0f}/{r['recover_s']:.1f}s" for k, r in sorted(runs[who].items())
        )
        s = sweep_row(runs[who])
        print(
            f"  {who:9s} {cells} | steps lost mean {s['steps_lost_mean']:.2f} worst "
            f"{s['steps_lost_max']:.0f}; recovery mean {s['recover_s_mean']:.1f} s "
            f"worst {s['recover_s_max']:.1f} s"
        )
    print(f"crash at step {FAULT_STEP}, vigil: {_cells(runs['vigil'][FAULT_STEP])}")
    user = runs["user_loop"]
    print(
        f"user DDP loop with vigil.agent.snapshots, 4 ranks on 2 nodes (its own record): "
        f"SIGKILL in step {USER_KILL_STEP} lost {user['crash_steps_lost']} steps, node memory "
        f"lost + kill in step {USER_DROP_STEP} lost {user['node_loss_steps_lost']} (target <= 1)"
    )
    print(f"hang at step {FAULT_STEP} (rank 1 stops before its collectives):")
    print(f"  vigil     found by the collector's hang check: {_cells(runs['vigil_hang'])}")
    hang = runs["torchrun_hang"]
    print(
        "  torchrun  no hang detection of its own; gloo's process-group timeout "
        f"({args.torchrun_timeout:g} s; torch's default 1,800 s) fails the waiting rank: "
        f"{_cells(hang)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", type=Path, help="keep every run's files here")
    parser.add_argument(
        "--crash-steps",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=CRASH_STEPS,
        help=f"crash steps to sweep (comma-separated; default one checkpoint interval, "
        f"{','.join(map(str, CRASH_STEPS))}); must include {FAULT_STEP}",
    )
    parser.add_argument(
        "--torchrun-timeout",
        type=float,
        default=60.0,
        help="the gloo process-group timeout (s) of torchrun's hang case",
    )
    args = parser.parse_args()
    if FAULT_STEP not in args.crash_steps or not all(1 < k < STEPS for k in args.crash_steps):
        parser.error(f"--crash-steps must lie in 2..{STEPS - 1} and include {FAULT_STEP}")
    root = (args.keep or Path(tempfile.mkdtemp(prefix="vigil-bench-recovery-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.chdir(root)  # what the agent and the ranks write to ./ (hung ranks' stacks) stays here
    runs: dict[str, Any] = {"vigil": {}, "torchrun": {}}
    with demo.platform(root) as url:
        # Step 8 first: its job's finding ids are the first of their kind in this collector.
        for k in sorted(args.crash_steps, key=lambda k: k != FAULT_STEP):
            runs["vigil"][k] = vigil_case("crash", url, root, k)
        runs["vigil_hang"] = vigil_case("hang", url, root)
        bare = bare_case(url, root, root / f"vigil-crash-{FAULT_STEP}")
        for k in args.crash_steps:
            runs["torchrun"][k] = torchrun_case("crash", url, root, k, 60.0)
        runs["torchrun_hang"] = torchrun_case("hang", url, root, FAULT_STEP, args.torchrun_timeout)
    runs["user_loop"] = user_loop_case(root)
    report(args, bare, runs)
    crash, hang = runs["vigil"][FAULT_STEP], runs["vigil_hang"]
    torchrun, torchrun_hang = runs["torchrun"][FAULT_STEP], runs["torchrun_hang"]
    ours, theirs = sweep_row(runs["vigil"]), sweep_row(runs["torchrun"])
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
        "crash_steps_swept": list(args.crash_steps),
        "vigil_crash_steps_lost_mean": round(ours["steps_lost_mean"], 2),
        "vigil_crash_steps_lost_max": ours["steps_lost_max"],
        "torchrun_crash_steps_lost_mean": round(theirs["steps_lost_mean"], 2),
        "torchrun_crash_steps_lost_max": theirs["steps_lost_max"],
        "vigil_crash_recover_s_mean": round(ours["recover_s_mean"], 2),
        "torchrun_crash_recover_s_mean": round(theirs["recover_s_mean"], 2),
        "vigil_hang_recover_s": round(hang["recover_s"], 2),
        "torchrun_hang_timeout_s": args.torchrun_timeout,
        "torchrun_hang_detect_s": round(torchrun_hang["detect_s"], 2),
        "torchrun_hang_recover_s": round(torchrun_hang["recover_s"], 2),
        "torchrun_hang_steps_lost": torchrun_hang["steps_lost"],
        "user_loop_crash_steps_lost": runs["user_loop"]["crash_steps_lost"],
        "user_loop_node_loss_steps_lost": runs["user_loop"]["node_loss_steps_lost"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
