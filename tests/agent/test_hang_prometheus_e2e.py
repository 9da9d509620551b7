"""A deliberately hung rank, seen by the real node agent and a real Prometheus (one launch).

`vigil agent` runs as its own process (as on a node), watching the progress pages of a 2-rank
gloo job in which rank 1 hangs before step 8's all-reduce. A real Prometheus (Debian's binary,
on loopback) scrapes the agent every second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent import conftest
from vigil import codec, schema
from vigil.agent import progress

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
JOB = "hangjob"
HANG_STEP = 8


def _records(path: Path) -> list[schema.Record]:
    if not path.exists():
        return []
    return [codec.decode_json(line) for line in path.read_bytes().splitlines() if line]


class Scene:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.out = base / "out"
        self.pages = base / "pages"
        self.metrics_port = conftest.free_port()
        self.agent_log = base / "agent.log"

    def page(self, rank: int) -> progress.PageSnapshot:
        reader = progress.PageReader(progress.page_path(self.pages, JOB, rank))
        try:
            return reader.snapshot()
        finally:
            reader.close()

    def agent_records(self) -> list[schema.Record]:
        return _records(self.out / "_agent" / "agent-testnode.jsonl")

    def rank_records(self, rank: int) -> list[schema.Record]:
        return _records(self.out / JOB / f"rank-{rank:05d}.jsonl")

    def hang_findings(self) -> dict[int, schema.Finding]:
        return {
            r.subjects.ranks[0]: r
            for r in self.agent_records()
            if isinstance(r, schema.Finding) and r.kind is schema.FindingKind.HANG
        }


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    scene = Scene(tmp_path_factory.mktemp("hang"))
    agent_log = open(scene.agent_log, "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vigil",
            "agent",
            "--node",
            "testnode",
            "--progress-dir",
            str(scene.pages),
            "--output-dir",
            str(scene.out),
            "--metrics-port",
            str(scene.metrics_port),
            "--poll-interval",
            "0.2",
            "--sample-interval",
            "1",
            "--min-hang",
            "2",
            "--hang-factor",
            "3",
        ],
        stdout=agent_log,
        stderr=subprocess.STDOUT,
    )
    prometheus = conftest.Prometheus(scene.base, [f"127.0.0.1:{scene.metrics_port}"])
    ranks = conftest.launch(
        "hang_job.py",
        2,
        [str(scene.out), str(scene.pages)],
        log_dir=scene.base,
        env={"NODE_NAME": "testnode"},
    )
    scene.prometheus = prometheus  # type: ignore[attr-defined]
    scene.agent = agent  # type: ignore[attr-defined]
    try:
        conftest.poll_until(
            lambda: 1 in scene.hang_findings() and 0 in scene.hang_findings(),
            timeout_s=90,
            what="the agent to flag both ranks",
        )
        yield scene
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait(10)
        prometheus.stop()
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(20)
        agent_log.close()


def test_hung_rank_page_shows_its_last_collective(scene: Scene) -> None:
    waiting, hung = scene.page(0), scene.page(1)
    # Rank 0 entered step 8's all-reduce and waits in it; rank 1 never got there.
    assert waiting.state is schema.RankState.IN_COLLECTIVE
    assert (waiting.last_group, waiting.last_op) == ("world", "all_reduce")
    assert waiting.last_step == hung.last_step == HANG_STEP
    assert hung.state is schema.RankState.COMPUTE
    assert hung.last_seq == waiting.last_seq - 1 == HANG_STEP
    assert hung.pid != os.getpid() and hung.pid > 0


def test_agent_flags_the_hang_with_stacks_and_ring(scene: Scene) -> None:
    findings = scene.hang_findings()
    hung = findings[1]
    assert hung.job_id == JOB and hung.step_start == HANG_STEP
    assert "py-spy" in hung.summary and f"#{HANG_STEP}" in hung.summary
    (evidence,) = hung.evidence
    assert evidence.observed > evidence.baseline >= 2.0  # learned threshold, >= --min-hang
    assert "hang_here" in evidence.note  # rank 1's Python stack, captured from outside
    assert "all_reduce" in findings[0].evidence[0].note  # rank 0 is stuck inside the collective
    events = [r for r in scene.agent_records() if isinstance(r, schema.CollectiveEvent)]
    assert {(e.rank, e.seq) for e in events} >= {(0, HANG_STEP + 1), (1, HANG_STEP)}
    # Saved beside the run's own JSON lines (its manifest names them), where `vigil analyze` looks.
    stack_files = list((scene.out / JOB / "stacks").glob("stacks-*-py-spy-rank-00001.txt"))
    assert stack_files and "hang_here" in stack_files[0].read_text()


def test_sdk_keeps_heartbeating_and_dumps_its_ring_while_stuck(scene: Scene) -> None:
    def stuck_records() -> list[schema.Record] | None:
        records = scene.rank_records(0)
        beats = [r for r in records if isinstance(r, schema.Heartbeat)]
        late = [b for b in beats if b.state is schema.RankState.IN_COLLECTIVE]
        ring = [r for r in records if isinstance(r, schema.CollectiveEvent)]
        return records if len(late) >= 3 and ring else None

    records = conftest.poll_until(stuck_records, timeout_s=30, what="heartbeats while stuck")
    ring = [r for r in records if isinstance(r, schema.CollectiveEvent)]
    assert ring[-1].seq == HANG_STEP + 1 and ring[-1].end_s == 0.0  # entered, never finished
    steps = [r.step for r in records if isinstance(r, schema.StepRecord)]
    assert steps == list(range(HANG_STEP))


def test_prometheus_scrapes_the_ranks_step_time(scene: Scene) -> None:
    prometheus: Any = scene.prometheus  # type: ignore[attr-defined]
    query = f'vigil_sdk_step_time_seconds{{job_id="{JOB}",rank="0",node="testnode"}}'
    result = conftest.poll_until(lambda: prometheus.query(query), timeout_s=30, what=query)
    value = float(result[0]["value"][1])
    assert 0.1 <= value < 5.0  # each step sleeps 0.1 s, then all-reduces
    # Both ranks stalled (rank 1 hung, rank 0 waiting for it); the next scrapes show both.
    conftest.poll_until(
        lambda: prometheus.query("vigil_agent_hangs_detected_total >= 2"),
        timeout_s=10,
        what="two hangs counted",
    )

    def both_suspected() -> list[dict[str, Any]] | None:
        found = prometheus.query(f'vigil_sdk_hang_suspected{{job_id="{JOB}"}} == 1')
        return found if len(found) == 2 else None

    suspected = conftest.poll_until(
        both_suspected,
        timeout_s=10,
        what="both ranks suspected",
    )
    assert {r["metric"]["rank"] for r in suspected} == {"0", "1"}
    cpu = prometheus.query('vigil_host_cpu_utilization_ratio{node="testnode"}')
    assert 0.0 <= float(cpu[0]["value"][1]) <= 1.0


def test_agent_said_once_that_nvml_is_missing_and_stops_cleanly(scene: Scene) -> None:
    agent: Any = scene.agent  # type: ignore[attr-defined]
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(20) == 0
    log = scene.agent_log.read_text()
    assert log.count("NVML unavailable") == 1
