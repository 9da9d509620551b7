"""kill -9 the collector while a real job runs: after it restarts on the same store, its
streaming analyzer picks the job up (the job never resends its Job record; a hung job sends only
heartbeats) and the straggler and the hang are still found, naming their rank."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.collector.test_crash import Collector, _free_port
from tests.realjobs import launch as launcher

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(600)]


def _last_step(url: str, job: str) -> int:
    try:
        r = httpx.get(f"{url}/api/v1/jobs/{job}/state", timeout=2)
    except httpx.HTTPError:
        return -1
    return int(r.json().get("last_step") or -1) if r.status_code == 200 else -1


def _kill_and_restart_at(
    collector: list[Collector], job: str, step: int, store: str, data: Path, port: int
) -> None:
    deadline = time.monotonic() + 300
    while _last_step(collector[0].url, job) < step:
        assert time.monotonic() < deadline, f"{job} never reached step {step}"
        time.sleep(0.2)
    collector[0].kill()
    collector[0] = Collector(store, data, port)


def _findings(url: str, job: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(f"{url}/api/v1/jobs/{job}/findings", timeout=10).json()
    return found


def test_findings_survive_a_collector_killed_mid_run(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'collector.sqlite3'}"
    port = _free_port()
    collector = [Collector(store, tmp_path, port)]
    cases: list[dict[str, Any]] = [
        {
            "job": "restart-straggler",
            "steps": 44,
            "seed": 4,
            "fault": {"kind": "slow", "rank": 1, "factor": 2.0, "where": "forward"},
        },
        {
            "job": "restart-hang",
            "steps": 24,
            "seed": 5,
            "fault": {"kind": "hang", "rank": 2, "step": 16, "seconds": 8.0, "where": "before"},
        },
    ]

    def kills() -> None:
        _kill_and_restart_at(collector, "restart-straggler", 5, store, tmp_path, port)
        # During the hang itself: after the restart only heartbeats arrive.
        _kill_and_restart_at(collector, "restart-hang", 15, store, tmp_path, port)

    killer = threading.Thread(target=kills, daemon=True)
    killer.start()
    try:
        result = launcher.launch(
            "plain", cases, tmp_path / "out", collector=collector[0].url, timeout_s=400
        )
        killer.join(timeout=60)
        assert not killer.is_alive(), "the collector was not killed twice"
        assert result.exit_codes == [0, 0, 0, 0], f"see {result.logs}"
        time.sleep(3.0)  # the last flushes and the analyzer's queue
        url = collector[0].url
        stragglers = [f for f in _findings(url, "restart-straggler") if f["kind"] == "straggler"]
        assert [f["subjects"]["ranks"] for f in stragglers] == [[1]], stragglers
        hangs = [f for f in _findings(url, "restart-hang") if f["kind"] == "hang"]
        assert hangs and hangs[0]["subjects"]["ranks"] == [2], hangs
        silent = hangs[0]["evidence"][0]
        assert silent["metric"] == "seconds_without_progress" and silent["observed"] < 8.0
        others = [f for f in _findings(url, "restart-hang") if f["kind"] != "hang"]
        assert others == [], [f["summary"] for f in others]
    finally:
        collector[0].stop()
