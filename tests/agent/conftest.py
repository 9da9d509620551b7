"""Fixtures for the agent tests: free ports and launching real multi-process gloo jobs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    script: str, world: int, args: Sequence[str], *, log_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """Start `world` processes of `HERE/script RANK WORLD PORT *args`; stdout+stderr to files."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for rank in range(world):
        log = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), str(rank), str(world), str(port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        log.close()
    return procs


def wait_all(procs: Sequence[subprocess.Popen[bytes]], *, timeout_s: float, log_dir: Path) -> None:
    """Wait for every process; on timeout or failure kill the rest and show their logs."""
    try:
        for proc in procs:
            proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    codes = [p.returncode for p in procs]
    if any(codes):
        logs = "\n".join(
            f"--- rank {i} (rc {c})\n" + (log_dir / f"rank{i}.log").read_text()[-3000:]
            for i, c in enumerate(codes)
        )
        raise AssertionError(f"ranks failed: {codes}\n{logs}")
