"""The Kubernetes controller's checkpoint and stack dumps through the collector's control path.

The controller runs with the Kubernetes executor on kmock's emulator and a real collector app
(in process, over ASGI); a stand-in for the node agents answers the collector's pending requests
by node, as `vigil agent` does (the real agent and SDK are exercised end to end in
tests/agent/test_control_path.py). What a user sees: the checkpoint action succeeds through
the API before the quarantine, the hang's stacks are the ranks' own (no pod exec), and the
requests and acknowledgements are in the collector.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.recovery.k8s.cluster import running
from tests.recovery.k8s.test_recovery import NS, executor, hang, run_controller, straggler
from vigil import api, codec, schema
from vigil.collector import CollectorSettings, create_app
from vigil.recovery import kubernetes as kube
from vigil.recovery.collector_link import CollectorControl
from vigil.schema import ActionState, DiagResult, Verdict


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[TestClient]:
    settings = CollectorSettings(data_dir=tmp_path, store_url=f"sqlite:///{tmp_path / 's.db'}")
    with TestClient(create_app(settings)) as c:
        yield c


class Agents:
    """Stands in for the node agents: polls each node's pending requests and acknowledges them
    for the ranks there (a dump_stacks answer carries a stack naming the rank)."""

    def __init__(self, client: TestClient, nodes: list[str]) -> None:
        self.client, self.nodes = client, nodes
        self.answered: list[tuple[str, str, tuple[int, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Agents:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            for node in self.nodes:
                for req in self.client.get("/api/v1/control", params={"node": node}).json():
                    details = (
                        {
                            str(r): f"Thread 0x1 (rank {r})\n  wait (train.py:7)\n"
                            for r in req["ranks"]
                        }
                        if req["kind"] == "dump_stacks"
                        else {}
                    )
                    body = {"node": node, "ranks": req["ranks"], "details": details}
                    assert self.client.post(
                        f"/api/v1/control/{req['id']}/ack", json=body
                    ).is_success
                    self.answered.append((node, req["kind"], tuple(req["ranks"])))


def _report_ranks(client: TestClient, ex: kube.KubernetesExecutor) -> list[str]:
    """The ranks' RankInfo as the SDK ships it: rank i runs in pod slot i."""
    slots = ex.slots()
    records: list[schema.Record] = [
        schema.RankInfo(job_id="train", rank=s.ordinal, node=s.node, world_size=len(slots))
        for s in slots
    ]
    frame = codec.encode_batch(records, batch_id="ranks")
    headers = {"content-type": api.BATCH_MEDIA_TYPE}
    assert client.post(api.INGEST_PATH, content=frame, headers=headers).status_code == 200
    return sorted({s.node for s in slots})


def test_checkpoint_goes_through_the_collector_before_the_quarantine(
    collector: TestClient,
) -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, fake):
        fake.finish_generation = 1
        cluster.diag_logs["node-1"] = codec.encode_json(
            DiagResult(node="node-1", device="cpu", test="matmul", value=1.0, verdict=Verdict.FAIL)
        ).decode()
        ex = executor(cluster)
        nodes = _report_ranks(collector, ex)
        control = CollectorControl(url="http://testserver", job_id="train", client=collector)
        with Agents(collector, nodes) as agents:
            code, book = run_controller(cluster, ex, [straggler("node-1")], checkpointer=control)
        assert code == 0
        ckpt = book.get("straggler-node-1/0-checkpoint")
        assert ckpt is not None and ckpt.state is ActionState.SUCCEEDED, ckpt
        kinds = [k for _, k, _ in agents.answered]
        assert kinds.count("checkpoint") == len(nodes)  # once per node, every rank there
        acked = sorted(r for _, k, ranks in agents.answered if k == "checkpoint" for r in ranks)
        assert acked == [0, 1, 2, 3]
        restart = [a for a in book.actions() if a.kind.value in ("restart", "migrate")]
        assert restart and all(ckpt.end_s <= a.start_s for a in restart)


def test_hang_stacks_come_from_the_ranks_through_the_collector(collector: TestClient) -> None:
    with running(NS, nodes=4, replicas=4) as (cluster, fake):
        fake.finish_generation = 1
        execs: list[str] = []

        def pod_exec(pod: str, command: list[str]) -> str:
            execs.append(pod)
            return ""

        control = CollectorControl(url="http://testserver", job_id="train", client=collector)
        ex = executor(cluster, pod_exec=pod_exec, control=control, stacks_timeout_s=20.0)
        nodes = _report_ranks(collector, ex)
        with Agents(collector, nodes):
            code, book = run_controller(cluster, ex, [hang()])
        assert code == 0
        stacks = book.get("hang-1/0-dump_stacks")
        assert stacks is not None and stacks.state is ActionState.SUCCEEDED
        assert "4 stacks" in stacks.result
        assert execs == []  # every rank answered: no pod exec
        folder = Path(stacks.result.split(" in ", 1)[1].split(":", 1)[0])
        assert "(rank 2)" in (folder / "rank-2.txt").read_text()


def test_stacks_of_ranks_that_do_not_answer_fall_back_to_the_pod_exec(
    collector: TestClient,
) -> None:
    with running(NS, nodes=4, replicas=4) as (cluster, _fake):
        control = CollectorControl(url="http://testserver", job_id="train", client=collector)
        ex = executor(
            cluster,
            pod_exec=lambda pod, cmd: f"py-spy of {pod}",
            control=control,
            stacks_timeout_s=0.3,
        )
        _report_ranks(collector, ex)
        out = ex.dump_stacks([0, 1])  # no agent answers
        assert sorted(out) == [0, 1] and all(
            t.startswith("py-spy of train-workers") for t in out.values()
        )


def test_a_job_whose_ranks_never_reported_is_not_waited_for(collector: TestClient) -> None:
    control = CollectorControl(url="http://testserver", job_id="unknown", client=collector)
    started = time.monotonic()
    assert control.request(timeout_s=30.0) is False
    assert control.stacks([0], timeout_s=0.2) == {}
    assert time.monotonic() - started < 5.0
