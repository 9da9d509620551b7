"""Local executor: runs a job's ranks as processes on this host, the way torchrun does.

Each rank gets torchrun's rendezvous environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, ...) plus VIGIL_NODE and the restart count (`RANK_ENV` lists it all, for `vigil run
--help`). Each attempt gets a fresh MASTER_PORT, so restarted gloo workers never meet the previous
attempt's TCPStore (the reason `torchrun --max-restarts` cannot bring gloo jobs back). Ranks run
in their own process groups so stopping a rank stops everything it spawned. Simulated nodes are
just labels on groups of ranks; a node's diagnostics (`diagnose`) run as a `vigil diag --quick`
subprocess pinned to the devices that node's ranks use (LOCAL_RANK 0..n-1 of the host's GPUs; the
CPU suite where there are none), at the lowest CPU priority (`nice -n 19`).

A command that cannot run is a configuration error, not a crash: the executor refuses one whose
executable it cannot find at construction, and reports a rank's exit 126 (found but not
executable) or 127 (not found) as `BAD_CONFIG_EXIT`, which the controller never restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from vigil import codec
from vigil.agent import stacks as stacks_mod
from vigil.env import EnvVar
from vigil.recovery import snapshot_files
from vigil.recovery.executor import RankExit
from vigil.recovery.placement import Placement
from vigil.schema import DiagResult

if TYPE_CHECKING:
    from vigil.recovery.executor import Executor

log = logging.getLogger(__name__)
# py-spy attaches and walks every thread in well under a second; 20 s covers a loaded node.
PY_SPY_TIMEOUT_S = 20.0

# The shell's "found but cannot execute" and "command not found" exit codes (POSIX).
NOT_EXECUTABLE_EXIT = 126
NOT_FOUND_EXIT = 127
# The controller stops the job instead of restarting on this code (controller.BAD_CONFIG_EXIT).
BAD_CONFIG_EXIT = 2
# The wrapper shell reports a command killed by signal n as exit 128+n (POSIX); poll() reports
# it as -n, as Popen does (a command that itself exits 129..159 reads as a signal too).
_SIGNALLED = 128
_UNRUNNABLE = {NOT_EXECUTABLE_EXIT: "could not be executed", NOT_FOUND_EXIT: "was not found"}

# Runs the rank's command and leaves "<exit code> <unix time>" in $VIGIL_EXIT_FILE, so a restarted
# controller that cannot wait() on its predecessor's children still learns how and when they ended.
# The TERM/INT traps are handlers, not ignores, so the training process keeps default signals.
_WRAPPER = (
    'trap : TERM INT; "$@"; code=$?; '
    f'printf "%s %s" "$code" "$(date +%s.%N)" > "${EnvVar.EXIT_FILE}.tmp"; '
    f'mv "${EnvVar.EXIT_FILE}.tmp" "${EnvVar.EXIT_FILE}"; exit $code'
)


# What every rank's environment holds beyond the caller's (`vigil run --help` prints this list).
RANK_ENV: tuple[tuple[str, str], ...] = (
    ("RANK", "the rank, 0 .. WORLD_SIZE-1"),
    ("WORLD_SIZE", "ranks in this attempt (smaller after a resize)"),
    ("LOCAL_RANK", "the rank's index on its node (its GPU: cuda:LOCAL_RANK)"),
    ("LOCAL_WORLD_SIZE", "ranks per node"),
    ("GROUP_RANK, NODE_RANK", "the index of the rank's node among the active nodes"),
    ("MASTER_ADDR", "the rendezvous host (127.0.0.1)"),
    ("MASTER_PORT", "the rendezvous port: a free one, new each attempt"),
    ("TORCHELASTIC_RESTART_COUNT", "the attempt, as torchrun names it"),
    ("PYTHONUNBUFFERED", "1, so output reaches the rank's log as it is printed"),
    (EnvVar.JOB.value, "the job id (vigil run --job), so every rank reports under one job"),
    (EnvVar.NODE.value, "the simulated node the rank runs on (node-0, node-1, ...)"),
    (EnvVar.RESTART_COUNT.value, "the attempt: 0 at the first start, +1 per restart"),
    (EnvVar.SNAPSHOT_DIR.value, "node shared memory for per-step snapshots (--snapshot-dir)"),
    (EnvVar.EXIT_FILE.value, "where the rank's wrapper leaves its exit code (internal)"),
)
# 5 min: the quick suite takes seconds on a CPU and about a minute on a GPU node.
DIAGNOSE_TIMEOUT_S = 300.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(kw_only=True)
class LocalExecutor:
    command: Sequence[str]
    run_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    # Node shared memory for per-step snapshots; each simulated node gets its own folder in it.
    snapshot_root: Path | None = None
    clock: Callable[[], float] = time.time
    # The node diagnostics' command (one JSON DiagResult per line on stdout, exit 0 or 1 by
    # verdict); `--node NODE` is appended. Default: this Python's `vigil diag --quick --json`.
    diag_command: Sequence[str] = (sys.executable, "-m", "vigil", "diag", "--quick", "--json")
    _procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict, init=False)
    _adopted: dict[int, int] = field(default_factory=dict, init=False)
    _attempt: int = field(default=0, init=False)
    _placement: Placement | None = field(default=None, init=False)
    _cordoned: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("the training command is empty: give it after `--`")
        problem = executable_problem(self.command[0], self.env.get("PATH", os.environ.get("PATH")))
        if problem:
            raise ValueError(problem)

    def launch(self, placement: Placement, attempt: int) -> None:
        if self._procs and self.alive():
            raise RuntimeError("launch() while ranks of the previous attempt are still running")
        for node in placement.active:
            if node in self._cordoned:
                raise ValueError(f"node {node} is cordoned and cannot run ranks")
        self._procs.clear()
        self._adopted.clear()
        self._placement = placement
        self._attempt = attempt
        port = free_port(self.master_addr)
        folder = self.attempt_dir(attempt)
        folder.mkdir(parents=True, exist_ok=True)
        for rank in range(placement.world_size):
            env = self._rank_env(placement, rank, attempt, port)
            env[EnvVar.EXIT_FILE] = str(folder / f"rank-{rank}.exit")
            out = open(folder / f"rank-{rank}.log", "wb")  # noqa: SIM115 - owned by the child
            try:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", _WRAPPER, "vigil-rank", *self.command],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                out.close()
            self._procs[rank] = proc
            (folder / f"rank-{rank}.pid").write_text(str(proc.pid))
        log.info(
            "attempt %d: started %d ranks on %s (MASTER_PORT %d)",
            attempt,
            placement.world_size,
            ",".join(placement.active),
            port,
        )

    def _rank_env(self, placement: Placement, rank: int, attempt: int, port: int) -> dict[str, str]:
        node = placement.node_of(rank)
        env = dict(os.environ)
        env.update(self.env)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(placement.world_size),
            LOCAL_RANK=str(rank % placement.ranks_per_node),
            LOCAL_WORLD_SIZE=str(placement.ranks_per_node),
            GROUP_RANK=str(placement.active.index(node)),
            NODE_RANK=str(placement.active.index(node)),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT=str(attempt),
            PYTHONUNBUFFERED="1",
        )
        env[EnvVar.RESTART_COUNT] = str(attempt)
        env[EnvVar.NODE] = node
        if self.snapshot_root is not None:
            env[EnvVar.SNAPSHOT_DIR] = str(self.snapshot_root)
        return env

    def attempt_dir(self, attempt: int) -> Path:
        """Where attempt `attempt`'s rank logs (rank-<r>.log), pid and exit files go."""
        return self.run_dir / "attempts" / f"attempt-{attempt}"

    def current_attempt_dir(self) -> Path | None:
        """The running (or last) attempt's folder; None before the first launch."""
        return None if self._placement is None else self.attempt_dir(self._attempt)

    def adopt(self, placement: Placement, attempt: int) -> int:
        """Take over the ranks a previous controller started for `attempt`; how many it started.

        Fewer than the world size means the launch was cut short: the caller must kill that
        attempt and launch it again, never join it.
        """
        folder = self.attempt_dir(attempt)
        pid_files = sorted(folder.glob("rank-*.pid")) if folder.exists() else []
        self._placement, self._attempt = placement, attempt
        self._procs.clear()
        self._adopted = {int(p.stem.split("-")[1]): int(p.read_text()) for p in pid_files}
        if self._adopted:
            log.info("adopted %d ranks of attempt %d", len(self._adopted), attempt)
        return len(self._adopted)

    def poll(self) -> list[RankExit]:
        assert self._placement is not None or not (self._procs or self._adopted)
        exits = []
        for rank, proc in list(self._procs.items()):
            code = proc.poll()
            if code is not None:
                exits.append(self._exit(rank, code))
                del self._procs[rank]
        for rank, pid in list(self._adopted.items()):
            if not _pid_alive(pid):
                exits.append(self._exit(rank, None))
                del self._adopted[rank]
        return sorted(exits, key=lambda e: e.seen_s)

    def _exit(self, rank: int, returncode: int | None) -> RankExit:
        assert self._placement is not None
        exit_file = self.attempt_dir(self._attempt) / f"rank-{rank}.exit"
        seen = self.clock()
        try:
            code_text, when = exit_file.read_text().split()
            code, seen = int(code_text), float(when)
        except (OSError, ValueError):
            # Killed before the wrapper could write (SIGKILL): trust wait() if we have it.
            code = returncode if returncode is not None else -signal.SIGKILL
        if _SIGNALLED < code < _SIGNALLED + 32:
            code = _SIGNALLED - code  # the shell's 128+n for a child killed by signal n: -n
        if code in _UNRUNNABLE:
            log.error(
                "rank %d exited %d: its command %s (%s); restarting cannot help, stopping the job",
                rank,
                code,
                _UNRUNNABLE[code],
                _last_line(self.attempt_dir(self._attempt) / f"rank-{rank}.log") or "no output",
            )
            code = BAD_CONFIG_EXIT
        return RankExit(rank, self._placement.node_of(rank), code, seen)

    def alive(self) -> list[int]:
        own = [r for r, p in self._procs.items() if p.poll() is None]
        return sorted(own + [r for r, pid in self._adopted.items() if _pid_alive(pid)])

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self._procs.items()} | dict(self._adopted)

    def stop(self, *, timeout_s: float) -> None:
        pids = list(self.pids().values())
        for pid in pids:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_group_alive(pid) for pid in pids):
            self._reap()
            time.sleep(0.05)
        for pid in pids:
            _signal_group(pid, signal.SIGKILL)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("rank process %d did not die after SIGKILL", proc.pid)
        self._procs.clear()
        self._adopted.clear()

    def kill_attempt(self, attempt: int) -> None:
        """Kill whatever a previous controller left running for `attempt` (pid files)."""
        folder = self.attempt_dir(attempt)
        for pid_file in folder.glob("rank-*.pid") if folder.exists() else []:
            _signal_group(int(pid_file.read_text()), signal.SIGKILL)

    def _reap(self) -> None:
        for proc in self._procs.values():
            proc.poll()

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        stacks: dict[int, str] = {}
        pids = self.pids()
        for rank in ranks:
            if rank not in pids or not _pid_alive(pids[rank]):
                continue
            try:  # the pid is the wrapper shell; the training process is its child
                children = psutil.Process(pids[rank]).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            pid = children[0].pid if children else pids[rank]
            text = stacks_mod.dump_with_py_spy(pid, timeout_s=PY_SPY_TIMEOUT_S)
            stacks[rank] = text if text is not None else "py-spy could not read this rank's stacks"
        return stacks

    def diagnose(self, node: str, *, timeout_s: float = DIAGNOSE_TIMEOUT_S) -> list[DiagResult]:
        """`vigil diag --quick` for `node`, pinned to the GPUs its ranks use (LOCAL_RANK 0..n-1
        of this host's visible ones; on a host without GPUs the CPU suite runs)."""
        per_node = self._placement.ranks_per_node if self._placement is not None else 1
        env = dict(os.environ)
        env.update(self.env)
        # The controller records and ships the results itself: the subprocess must not too.
        env.pop(EnvVar.COLLECTOR_URL, None)
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        devices = visible[:per_node] if visible else [str(i) for i in range(per_node)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        argv = [*self.diag_command, "--node", node]
        # At the lowest CPU priority: where the node's ranks still run (simulated nodes share
        # this host's cores), the diagnosis yields to them rather than slowing the job down.
        nice = shutil.which("nice", path=env.get("PATH"))
        if nice:
            argv = [nice, "-n", "19", *argv]
        try:
            done = subprocess.run(
                argv, env=env, capture_output=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"diagnostics of {node} did not finish in {timeout_s:.0f} s"
            ) from exc
        except OSError as exc:
            raise RuntimeError(f"diagnostics of {node} could not start: {exc}") from exc
        results = []
        for line in done.stdout.splitlines():
            if not line.strip():
                continue
            try:
                record = codec.decode_json(line)
            except codec.DecodeError:
                continue  # not a result line
            if isinstance(record, DiagResult):
                results.append(record)
        if done.returncode not in (0, 1) or not results:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(
                f"diagnostics of {node} failed (exit {done.returncode}, "
                f"{len(results)} results): {tail[0][:300]}"
            )
        return results

    def cordon(self, node: str) -> None:
        self._cordoned.add(node)

    def forget_node(self, node: str, job: str) -> None:
        """A node we moved away from is treated as lost: its shared memory goes with it."""
        if self.snapshot_root is not None:
            snapshot_files.drop_node(self.snapshot_root, job, node)


def executable_problem(program: str, path: str | None = None) -> str:
    """Why `program` (a path, or a name looked up on `path`) cannot be run; "" when it can."""
    if os.sep in program:
        target = Path(program)
        if not target.exists():
            return f"the command {program} does not exist"
        if target.is_dir():
            return f"the command {program} is a directory"
        if not os.access(target, os.X_OK):
            return f"the command {program} is not executable (chmod +x it, or name its interpreter)"
        return ""
    if shutil.which(program, path=path) is None:
        return f"the command {program!r} was not found on PATH"
    return ""


def _last_line(log_file: Path) -> str:
    """The last non-empty line a rank wrote (the shell's "not found" message), or ""."""
    try:
        with log_file.open("rb") as fh:
            fh.seek(max(0, log_file.stat().st_size - 4096))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


def _pid_alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


if TYPE_CHECKING:  # mypy checks that LocalExecutor implements the Executor protocol in full

    def _is_an_executor(executor: LocalExecutor) -> Executor:
        return executor
