"""`vigil demo`: the whole platform on one machine, with three faults to find and fix.

Starts a collector (SQLite, streaming analyzer on), a node agent and the recovery controller;
runs the bundled trainer on 4 ranks (dp 2 x tp 2 over two simulated nodes plus one spare) with
the SDK; injects a straggler, then a hang, then a crash. Each must be detected, the culprit named
and the job recovered. Prints one row per fault and exits 0 only if all three went right.
Orchestration only: detection is the analyzer's, decisions the policy's, actions the controller's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vigil import api
from vigil.agent import rundir
from vigil.env import EnvVar
from vigil.recovery import (
    attempts,
    checkpoint_request,
    collector_link,
    controller,
    journal,
    local,
    placement,
    policy,
)
from vigil.recovery.demo_report import FaultRow, build_rows

log = logging.getLogger(__name__)

# Rank 2 (node-1) turns 2.5x slower; rank 1 stops before its step's collectives (its peers wait
# in them); rank 3 crashes. Each fires in
# its own attempt, so every recovery faces a fresh fault.
STRAGGLER_RANK, HANG_RANK, CRASH_RANK = 2, 1, 3


@dataclass(frozen=True, kw_only=True)
class DemoPlan:
    """Steps at which faults fire; `quick` shortens every stretch (CI)."""

    slow_step: int
    hang_step: int
    crash_step: int
    steps: int
    # 2.5x compute on one rank: a straggler worth moving away from (policy: >= 1.5x is HIGH).
    slow_factor: float = 2.5

    @classmethod
    def make(cls, *, quick: bool) -> DemoPlan:
        # The straggler starts after the analyzer's start-up steps (StragglerConfig.
        # warmup_steps: 8), as a fault of a real run would. Gaps leave room for detection (a
        # straggler needs ~8 steps of evidence), for a restart to resume before the next
        # fault's step, and for the straggler's node diagnosis (which runs beside the resumed
        # job on this host's cores) to end before the hang fires.
        if quick:
            return cls(slow_step=9, hang_step=31, crash_step=39, steps=43)
        return cls(slow_step=10, hang_step=38, crash_step=50, steps=58)

    def faults(self) -> str:
        return ";".join(
            [
                f"slow:rank={STRAGGLER_RANK},step={self.slow_step},factor={self.slow_factor}",
                f"hang:rank={HANG_RANK},step={self.hang_step},where=before,attempt=1",
                f"crash:rank={CRASH_RANK},step={self.crash_step},attempt=2",
            ]
        )


@dataclass(kw_only=True)
class Services:
    """The collector and agent processes the demo starts (and stops)."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, argv: Sequence[str], log_path: Path, env: dict[str, str]) -> None:
        out = open(log_path, "wb")  # noqa: SIM115 - owned by the child
        try:
            self.procs.append(
                subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env)
            )
        finally:
            out.close()

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def wait_ready(url: str, *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}{api.API_PREFIX}/jobs", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"collector at {url} did not answer within {timeout_s:.0f} s")


@contextlib.contextmanager
def platform(workdir: Path, port: int = 0, *, keep: bool = False) -> Iterator[str]:
    """A collector (SQLite in `workdir`, streaming analyzer on) and a node agent; yields the URL.
    `keep`: the collector (and its web UI) goes on serving after the demo; its pid is written to
    `workdir/collector.pid`."""
    port = port or local.free_port()
    url = f"http://127.0.0.1:{port}"
    python = sys.executable
    env = {**os.environ, EnvVar.ANALYZER_TICK_S: "0.5", "PYTHONUNBUFFERED": "1"}
    env.pop(EnvVar.FAULTS, None)
    services = Services()
    try:
        services.start(
            [python, "-m", "vigil", "collector", "--port", str(port),
             "--store", f"sqlite:///{workdir / 'collector.sqlite3'}"],
            workdir / "collector.log", env,
        )  # fmt: skip
        wait_ready(url)
        services.start(
            [python, "-m", "vigil", "agent", "--collector", url,
             "--metrics-port", str(local.free_port()), "--no-nvml"],
            workdir / "agent.log", env,
        )  # fmt: skip
        yield url
    finally:
        if keep and services.procs:
            (workdir / "collector.pid").write_text(f"{services.procs[0].pid}\n")
            services.procs = services.procs[1:]
        services.stop()


def run(
    *, workdir: Path, quick: bool, port: int = 0, keep: bool = False
) -> tuple[int, list[FaultRow], str]:
    """Run the demo in `workdir`; returns (exit code, one row per fault, the collector URL)."""
    plan = DemoPlan.make(quick=quick)
    workdir.mkdir(parents=True, exist_ok=True)
    job = f"demo-{int(time.time())}"
    with platform(workdir, port, keep=keep) as url:
        code = supervise(
            TrainJob(job=job, url=url, workdir=workdir, steps=plan.steps, faults=plan.faults())
        )
        time.sleep(1.5)  # let the last batches land before reading the story back
        rows = build_rows(
            findings=collector_link.CollectorFindings(url=url, job_id=job).fetch(),
            actions=journal.Journal(workdir / "controller").actions(),
            steps_path=workdir / "steps.jsonl",
            plan_ranks={"straggler": STRAGGLER_RANK, "hang": HANG_RANK, "crash": CRASH_RANK},
            fault_steps={
                "straggler": plan.slow_step,
                "hang": plan.hang_step,
                "crash": plan.crash_step,
            },
        )
    ok = code == 0 and len(rows) == 3 and all(r.ok for r in rows)
    return (0 if ok else 1), rows, url


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """A bundled-trainer job under the controller (the demo's, or a benchmark's)."""

    job: str
    url: str
    workdir: Path
    steps: int
    faults: str = ""
    nproc: int = 4
    nodes: int = 2
    spare: int = 1
    layout: tuple[str, ...] = ("--dp", "2", "--tp", "2")
    ckpt_every: int = 10

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vigil", "train", "--recipe", "tiny", *self.layout,
            "--steps", str(self.steps), "--job", self.job, "--collector", self.url,
            "--ckpt-dir", str(self.workdir / "checkpoints"), "--ckpt-every", str(self.ckpt_every),
            "--timeout", "60", "--metrics-out", str(self.workdir / "steps.jsonl"),
            *(["--faults", self.faults] if self.faults else []),
        ]  # fmt: skip


def supervise(spec: TrainJob) -> int:
    """Run `spec` under a controller fed by the collector's findings; the controller's exit code."""
    executor = local.LocalExecutor(
        command=spec.command(),
        run_dir=spec.workdir / "controller",
        env={EnvVar.JOB: spec.job, EnvVar.COLLECTOR_URL: spec.url},
        snapshot_root=spec.workdir / "shm",
    )
    controller_dir = spec.workdir / "controller"
    ctl = controller.Controller(
        config=controller.ControllerConfig(
            job_id=spec.job,
            run_id=spec.job,
            max_restarts=5,
            poll_interval_s=0.25,
            checkpoint_timeout_s=20.0,
            budget=policy.Budget(cooldown_s=0.0),
        ),
        executor=executor,
        journal=journal.Journal(spec.workdir / "controller"),
        placement=placement.Placement.build(nproc=spec.nproc, nodes=spec.nodes, spare=spec.spare),
        findings=collector_link.CollectorFindings(url=spec.url, job_id=spec.job),
        checkpointer=checkpoint_request.PageCheckpointer(
            progress_dir=Path("/dev/shm/vigil"),
            job_id=spec.job,
            latest_committed=lambda: _newest_commit(spec.workdir / "checkpoints"),
        ),
        sink=journal.Tee(
            [
                journal.RecordLog(controller_dir / "record.jsonl"),
                collector_link.CollectorActions(
                    url=spec.url, spool_dir=spec.workdir / "controller-posts.spool"
                ),
            ]
        ),
        steps=attempts.ProgressWatch(
            job_id=spec.job,
            progress_root=rundir.progress_root(),
            remote=collector_link.CollectorSteps(url=spec.url, job_id=spec.job),
        ),
    )
    return ctl.run()


def describe(rows: Sequence[FaultRow]) -> str:
    return json.dumps([r.as_dict() for r in rows])


__all__ = ["DemoPlan", "TrainJob", "describe", "platform", "run", "supervise"]


def _newest_commit(root: Path) -> int:
    """The bundled trainer's newest committed checkpoint step under `root` (-1: none)."""
    from vigil.trainer import checkpoint  # torch: only once the demo runs

    return max(checkpoint.committed_steps(root), default=-1)
