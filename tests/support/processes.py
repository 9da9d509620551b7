"""Service processes the end-to-end tests start (a collector, node agents, Prometheus): each in a
session of its own with its output in a log file, and stopped with its whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session, stdout and stderr into `log`, `env` over this environment."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL it after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
