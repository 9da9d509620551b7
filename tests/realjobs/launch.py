"""Start `train.py` on N local processes the way torchrun does, and wait for them.

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and a fresh MASTER_PORT; output goes to
`<out>/launch-<n>/rank-<r>.log`. When one rank exits non-zero the others are given a moment
to notice (their collectives fail) and are then killed, as torchrun does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vigil.recovery.local import free_port

TRAIN = Path(__file__).with_name("train.py")

__all__ = ["Launch", "free_port", "launch"]


@dataclass(frozen=True)
class Launch:
    exit_codes: list[int]
    seconds: float
    logs: Path


def launch(
    wrapper: str,
    cases: list[dict[str, Any]],
    out: Path,
    *,
    nproc: int = 4,
    collector: str | None = None,
    rank_collector: dict[int, str] | None = None,
    timeout_s: float = 600.0,
    progress_dir: Path | None = None,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    rank_prefix: dict[int, list[str]] | None = None,
    master_addr: str = "127.0.0.1",
    device: str = "cpu",
) -> Launch:
    """`rank_env` / `rank_prefix`: per-rank extra environment and a command prefix (e.g.
    `ip netns exec NS` for a rank behind a slow link); `rank_collector`: per-rank collector URL
    in place of `collector` (e.g. its node agent's relay); `device`: train.py's `--device`."""
    out.mkdir(parents=True, exist_ok=True)
    logs = out / f"launch-{wrapper}-{time.monotonic_ns()}"
    logs.mkdir()
    spec = logs / "cases.json"
    spec.write_text(json.dumps(cases))
    port = free_port()
    procs = []
    started = time.monotonic()
    for rank in range(nproc):
        environ = {
            **os.environ,
            **(env or {}),
            **(rank_env or {}).get(rank, {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [*(rank_prefix or {}).get(rank, [])]
        cmd += [sys.executable, str(TRAIN), "--wrapper", wrapper, "--cases", str(spec)]
        cmd += ["--out", str(out)]
        ships_to = (rank_collector or {}).get(rank, collector)
        if ships_to:
            cmd += ["--collector", ships_to]
        if progress_dir is not None:
            cmd += ["--progress-dir", str(progress_dir)]
        if device != "cpu":
            cmd += ["--device", device]
        with open(logs / f"rank-{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    deadline = started + timeout_s
    first_failure: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if any(p.returncode not in (None, 0) for p in procs) and first_failure is None:
            first_failure = now
        if now > deadline or (first_failure is not None and now > first_failure + 15.0):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.1)
    return Launch([int(p.returncode) for p in procs], time.monotonic() - started, logs)
