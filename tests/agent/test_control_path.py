"""The control path across nodes, end to end with real processes: a collector, a `vigil agent`
on each of two (simulated) nodes and one SDK rank per node (the first node's rank ships through
its agent's relay, `--relay-port`, the second's straight to the collector). A checkpoint request
posted through the collector's API (`CollectorControl`, as the Kubernetes controller posts it)
reaches each rank through its node's agent and progress page, runs the rank's
`vigil.agent.on_control` callback, and the acknowledgements come back through the API, then rank
0's commit report (`vigil.agent.checkpoint_committed`, shipped as a Checkpoint record, through
the relay); a rank that acknowledges without a commit is reported as exactly that; a stack dump
request brings each rank's own dump back with its acknowledgement."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent.conftest import free_port, poll_until
from tests.support import processes
from vigil.recovery.collector_link import CollectorControl

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent
JOB = "ctljob"
NODES = ("node-a", "node-b")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _ranks_known(url: str) -> bool:
    try:
        rows = httpx.get(f"{url}/api/v1/jobs/{JOB}/ranks", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(rows, list) and {r.get("node") for r in rows} == set(NODES)


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [
        processes.start(
            [
                sys.executable,
                "-m",
                "vigil",
                "collector",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--store",
                f"sqlite:///{tmp_path / 'collector.sqlite3'}",
            ],
            tmp_path / "collector.log",
            {"VIGIL_DATA_DIR": str(tmp_path / "data")},
        )
    ]
    try:
        poll_until(lambda: _healthy(url), timeout_s=60, what="the collector")
        for i, node in enumerate(NODES):
            pages, out = tmp_path / node / "pages", tmp_path / node / "out"
            out.mkdir(parents=True)
            # The first node's rank ships through its agent's relay, the second's straight.
            relay_port = free_port()
            relay = ("--relay-port", str(relay_port)) if i == 0 else ()
            ships_to = f"http://127.0.0.1:{relay_port}" if i == 0 else url
            procs.append(
                processes.start(
                    [
                        sys.executable,
                        "-m",
                        "vigil",
                        "agent",
                        "--node",
                        node,
                        "--progress-dir",
                        str(pages),
                        "--output-dir",
                        str(out),
                        "--collector",
                        url,
                        "--metrics-port",
                        str(free_port()),
                        "--poll-interval",
                        "0.2",
                        "--sample-interval",
                        "5",
                        "--no-nvml",
                        *relay,
                    ],
                    tmp_path / f"agent-{node}.log",
                )
            )
            procs.append(
                processes.start(
                    [
                        sys.executable,
                        str(HERE / "control_job.py"),
                        str(i),
                        str(len(NODES)),
                        ships_to,
                        str(pages),
                        str(out),
                    ],
                    tmp_path / f"rank-{i}.log",
                    {"VIGIL_NODE": node},
                )
            )
        poll_until(lambda: _ranks_known(url), timeout_s=60, what="both ranks in the collector")
        yield url, tmp_path
    finally:
        for proc in reversed(procs):
            processes.stop(proc)


def test_a_checkpoint_request_runs_each_ranks_callback_and_is_acknowledged_through_the_api(
    scene: tuple[str, Path],
) -> None:
    url, base = scene
    control = CollectorControl(url=url, job_id=JOB, poll_s=0.2)
    outcome = control.request(timeout_s=60, request_id="ckpt-1")
    assert (outcome.acked, outcome.asked) == (2, 2), (
        f"the ranks did not acknowledge ({outcome}): "
        + "".join((base / f"agent-{n}.log").read_text()[-2000:] for n in NODES)
    )
    # Rank 0's commit report came back through the collector: the step it saved at.
    assert outcome.committed, outcome
    assert outcome.committed_step == int(
        (base / "node-a" / "out" / "checkpoint-rank-0").read_text()
    )
    assert outcome.location.endswith("checkpoint-rank-0")
    status = httpx.get(f"{url}/api/v1/jobs/{JOB}/control/ckpt-1", timeout=5).json()
    assert status["acked"] == [0, 1] and status["done"] is True
    for i, node in enumerate(NODES):
        marker = base / node / "out" / f"checkpoint-rank-{i}"
        assert marker.exists(), f"rank {i}'s checkpoint callback did not run"
        assert int(marker.read_text()) >= 0
    # Nothing is pending any more; one rank alone can be asked, and only its node delivers it.
    for node in NODES:
        assert httpx.get(f"{url}/api/v1/control", params={"node": node}, timeout=5).json() == []
    (base / "node-a" / "out" / "checkpoint-rank-0").unlink()
    (base / "node-b" / "out" / "checkpoint-rank-1").unlink()
    # Rank 1 alone: it acknowledges but reports no commit, and that is what the outcome says.
    lone = control.request(timeout_s=3, ranks=[1], request_id="ckpt-2")
    assert (lone.acked, lone.asked, lone.committed) == (1, 1, False), lone
    assert lone.describe(3) == "requested, acknowledged by 1 of 1 ranks, no commit seen within 3 s"
    assert (base / "node-b" / "out" / "checkpoint-rank-1").exists()
    assert not (base / "node-a" / "out" / "checkpoint-rank-0").exists()
    # Stacks on request: each rank's own dump (the SDK's faulthandler) comes back with its ack.
    stacks = control.stacks([0, 1], timeout_s=60, request_id="stacks-1")
    assert sorted(stacks) == [0, 1]
    for text in stacks.values():
        assert "dump_stacks requested" in text and "control_job.py" in text, text[:500]
    # A request no rank can answer (a rank the job does not have) times out, it does not hang.
    assert not control.acknowledged(timeout_s=1.5, ranks=[7], request_id="ckpt-3")
