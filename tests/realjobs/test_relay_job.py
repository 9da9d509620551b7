"""A real 4-rank job on two (simulated) nodes whose ranks ship through their node's relay
(`vigil.agent.relay`, as `vigil agent --relay-port` runs it) to a real collector: the streaming
analyzer still names the straggler and the hung rank, finds nothing else, and each relay forwarded
its node's batches several per request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.collector.test_crash import Collector, _free_port
from tests.realjobs import launch as launcher
from vigil.agent import relay

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(600)]


def _findings(url: str, job: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(f"{url}/api/v1/jobs/{job}/findings", timeout=10).json()
    return found


def test_findings_hold_when_ranks_ship_through_their_nodes_relays(tmp_path: Path) -> None:
    collector = Collector(f"sqlite:///{tmp_path / 'collector.sqlite3'}", tmp_path, _free_port())
    relays = [relay.RelayServer(collector.url) for _ in range(2)]  # the default 1 s window
    # Ranks 0-1 on the first node, 2-3 on the second.
    ships_to = {rank: relays[rank // 2].url for rank in range(4)}
    cases: list[dict[str, Any]] = [
        {
            "job": "relay-straggler",
            "steps": 44,
            "seed": 6,
            "fault": {"kind": "slow", "rank": 1, "factor": 2.0, "where": "forward"},
        },
        {
            "job": "relay-hang",
            "steps": 24,
            "seed": 7,
            "fault": {"kind": "hang", "rank": 2, "step": 16, "seconds": 8.0, "where": "before"},
        },
    ]
    try:
        result = launcher.launch(
            "plain", cases, tmp_path / "out", rank_collector=ships_to, timeout_s=400
        )
        assert result.exit_codes == [0, 0, 0, 0], f"see {result.logs}"
        time.sleep(3.0)  # the analyzer's queue
        stragglers = [
            f for f in _findings(collector.url, "relay-straggler") if f["kind"] == "straggler"
        ]
        assert [f["subjects"]["ranks"] for f in stragglers] == [[1]], stragglers
        others = [
            f for f in _findings(collector.url, "relay-straggler") if f["kind"] != "straggler"
        ]
        assert others == [], [f["summary"] for f in others]
        hangs = [f for f in _findings(collector.url, "relay-hang") if f["kind"] == "hang"]
        assert hangs and hangs[0]["subjects"]["ranks"] == [2], hangs
        silent = hangs[0]["evidence"][0]
        assert silent["metric"] == "seconds_without_progress" and silent["observed"] < 8.0
        others = [f for f in _findings(collector.url, "relay-hang") if f["kind"] != "hang"]
        assert others == [], [f["summary"] for f in others]
        for r in relays:
            # Every rank's batches went through it, two at a time once in step (a case's first and
            # last flushes come alone: 18 requests for 28 batches in a typical run).
            assert r.stats.frames > 20 and r.stats.requests < 0.8 * r.stats.frames, r.stats
    finally:
        for r in relays:
            r.close()
        collector.stop()
