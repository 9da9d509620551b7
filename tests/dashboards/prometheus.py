"""A real Prometheus (Debian's binary) on loopback for the dashboard tests and bench: several
scrape jobs, vigil's rule files loaded, 1 s scrape and evaluation. Test support only."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.agent import conftest


class Prometheus:
    def __init__(
        self,
        workdir: Path,
        jobs: dict[str, Sequence[str]],
        *,
        rule_files: Sequence[Path] = (),
        interval_s: float = 1.0,
    ) -> None:
        if not Path(conftest.PROMETHEUS).exists():
            raise RuntimeError("prometheus binary missing: scripts/setup.sh installs it (apt)")
        self.port = conftest.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        interval_ms = int(interval_s * 1000)
        lines = [
            f"global: {{scrape_interval: {interval_ms}ms, evaluation_interval: {interval_ms}ms}}",
            "rule_files: [" + ", ".join(f'"{p}"' for p in rule_files) + "]",
            "scrape_configs:",
        ]
        for name, targets in jobs.items():
            listed = ", ".join(f'"{t}"' for t in targets)
            lines += [f"  - job_name: {name}", f"    static_configs: [{{targets: [{listed}]}}]"]
        config = workdir / "prometheus.yml"
        config.write_text("\n".join(lines) + "\n")
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                conftest.PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--query.lookback-delta=30s",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.client.get("/-/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"prometheus did not become ready; see {workdir / 'prometheus.log'}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        response = self.client.get("/api/v1/query", params={"query": promql})
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"{promql}: {body.get('error', body)}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def query_range(self, promql: str, *, seconds: float, step_s: float) -> list[dict[str, Any]]:
        end = time.time()
        params = {"query": promql, "start": end - seconds, "end": end, "step": step_s}
        body = self.client.get("/api/v1/query_range", params=params).json()
        if body.get("status") != "success":
            raise AssertionError(f"{promql}: {body.get('error', body)}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()
