"""Fixtures for the agent tests: free ports and launching real multi-process gloo jobs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    script: str,
    world: int,
    args: Sequence[str],
    *,
    log_dir: Path,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start `world` processes of `HERE/script RANK WORLD PORT *args`; stdout+stderr to files."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
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


PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class Prometheus:
    """A real Prometheus server on loopback scraping `targets` every second (test helper)."""

    def __init__(self, workdir: Path, targets: Sequence[str]) -> None:
        if not Path(PROMETHEUS).exists():
            raise RuntimeError("prometheus binary missing: scripts/setup.sh installs it (apt)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        listed = ", ".join(f'"{t}"' for t in targets)
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: vigil-agent\n"
            f"    static_configs: [{{targets: [{listed}]}}]\n"
        )
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready(timeout_s=30)

    def _wait_ready(self, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"prometheus did not become ready (rc {self.proc.poll()})")

    def query(self, promql: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        response.raise_for_status()
        body = response.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


def poll_until(check: Callable[[], T | None], *, timeout_s: float, what: str) -> T:
    """Call `check` until it returns something truthy; fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.25)
