"""The `helm test` script (helm/vigil/files/helm_test.py) passes against a real collector and agent
and fails when one of them is not serving.

Both are started as `vigil collector` / `vigil agent` processes on loopback ports, with the
arguments the chart's test Pod passes (the controller's SelfSubjectAccessReviews need an API
server and are covered by tests/helm/test_chart.py's evaluation of the rendered RBAC instead).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helm import chart

SCRIPT = chart.CHART / "files" / "helm_test.py"
VIGIL = Path(sys.executable).with_name("vigil")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url}: the process exited ({proc.returncode})"
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout_s} s")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("helm-test")
    env = {**os.environ, "VIGIL_DATA_DIR": str(tmp / "data"), "VIGIL_PROGRESS_DIR": str(tmp)}
    env.pop("VIGIL_COLLECTOR_URL", None)
    cport, aport = _free_port(), _free_port()
    collector = subprocess.Popen(
        [VIGIL, "collector", "--port", str(cport), "--no-analyzer"], env=env
    )
    agent = subprocess.Popen(
        [VIGIL, "agent", f"--metrics-port={aport}", "--no-nvml", f"--progress-dir={tmp}/pages"],
        env={**env, "VIGIL_OUTPUT_DIR": str(tmp / "out")},
        stdout=subprocess.DEVNULL,
    )
    try:
        urls = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{aport}"
        _wait(urls[0] + "/healthz", collector)
        _wait(urls[1] + "/metrics", agent)
        yield urls
    finally:
        for proc in (collector, agent):
            proc.terminate()
        for proc in (collector, agent):
            proc.wait(timeout=30)


def _run(spec: dict[str, object]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, SCRIPT, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_helm_test_passes_against_a_serving_collector_and_agent(
    servers: tuple[str, str],
) -> None:
    collector, agent = servers
    done = _run({"collector": collector, "agent": agent, "access": []})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "collector /healthz: 200" in done.stdout
    assert "agent /metrics: 200" in done.stdout


def test_the_helm_test_fails_when_what_it_checks_is_not_there(servers: tuple[str, str]) -> None:
    collector, _ = servers
    # The collector's port answers /metrics but not an agent's series: the agent check fails.
    done = _run({"collector": collector, "agent": collector, "access": []})
    assert done.returncode == 1
    assert "FAILED: agent /metrics lacks vigil_agent_* series" in done.stdout
    dead = f"http://127.0.0.1:{_free_port()}"
    done = _run({"collector": dead, "agent": None, "access": []})
    assert done.returncode != 0
