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
from vigil.recovery import k8s_executor
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

    def __init__(self, client: TestClient, nodes: list[str], *, commit_step: int = -1) -> None:
        self.client, self.nodes = client, nodes
        # >= 0: rank 0 commits a checkpoint at this step once it took the request and reports
        # it as the SDK does (`vigil.agent.checkpoint_committed` ships a Checkpoint record).
        self.commit_step = commit_step
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
                    if req["kind"] == "checkpoint" and 0 in req["ranks"] and self.commit_step >= 0:
                        _ingest(
                            self.client,
                            schema.Checkpoint(
                                job_id="train",
                                step=self.commit_step,
                                location=f"/ckpt/step-{self.commit_step}",
                                committed_s=time.time(),
                            ),
                        )


def _ingest(client: TestClient, *records: schema.Record) -> None:
    frame = codec.encode_batch(list(records), batch_id=f"b-{time.monotonic_ns()}")
    headers = {"content-type": api.BATCH_MEDIA_TYPE}
    assert client.post(api.INGEST_PATH, content=frame, headers=headers).status_code == 200


def _report_ranks(client: TestClient, ex: k8s_executor.KubernetesExecutor) -> list[str]:
    """The ranks' RankInfo as the SDK ships it: rank i runs in pod slot i."""
    slots = ex.slots()
    _ingest(
        client,
        *(
            schema.RankInfo(job_id="train", rank=s.ordinal, node=s.node, world_size=len(slots))
            for s in slots
        ),
    )
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
        with Agents(collector, nodes, commit_step=5) as agents:
            code, book = run_controller(cluster, ex, [straggler("node-1")], checkpointer=control)
        assert code == 0
        ckpt = book.get("straggler-node-1/0-checkpoint")
        assert ckpt is not None and ckpt.state is ActionState.SUCCEEDED, ckpt
        assert ckpt.result == (
            "requested, acknowledged by 4 of 4 ranks, committed at step 5 (/ckpt/step-5)"
        )
        kinds = [k for _, k, _ in agents.answered]
        assert kinds.count("checkpoint") == len(nodes)  # once per node, every rank there
        acked = sorted(r for _, k, ranks in agents.answered if k == "checkpoint" for r in ranks)
        assert acked == [0, 1, 2, 3]
        restart = [a for a in book.actions() if a.kind.value in ("restart", "migrate")]
        assert restart and all(ckpt.end_s <= a.start_s for a in restart)


def test_an_acknowledged_checkpoint_that_never_commits_is_not_reported_as_committed(
    collector: TestClient,
) -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, fake):
        fake.finish_generation = 1
        ex = executor(cluster)
        nodes = _report_ranks(collector, ex)
        # An older checkpoint is there already and the job reported step 9: neither is the
        # commit this request asks for.
        _ingest(
            collector,
            schema.Checkpoint(job_id="train", step=3, location="/ckpt/step-3", committed_s=1.0),
            schema.StepRecord(
                job_id="train", rank=0, step=9, start_s=time.time(), end_s=time.time()
            ),
        )
        control = CollectorControl(
            url="http://testserver", job_id="train", client=collector, poll_s=0.05
        )
        with Agents(collector, nodes) as agents:  # every rank acknowledges; nothing commits
            code, book = run_controller(
                cluster, ex, [straggler("node-1")], checkpointer=control, checkpoint_timeout_s=1.0
            )
        assert code == 0
        assert sorted(r for _, k, rs in agents.answered if k == "checkpoint" for r in rs) == [
            0, 1, 2, 3
        ]  # fmt: skip
        ckpt = book.get("straggler-node-1/0-checkpoint")
        assert ckpt is not None and ckpt.state is ActionState.FAILED, ckpt
        assert ckpt.result == "requested, acknowledged by 4 of 4 ranks, no commit seen within 1 s"
        # The recovery went on without it: the job was still moved off node-1.
        migrate = book.get("straggler-node-1/2-migrate")
        assert migrate is not None and migrate.state is ActionState.SUCCEEDED
        # A checkpoint at a step before the request is not taken for its commit either.
        _ingest(
            collector,
            schema.Checkpoint(job_id="train", step=8, location="/ckpt/step-8", committed_s=2.0),
        )
        late = control.request(timeout_s=0.5)
        assert late.committed_step is None, late


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
    outcome = control.request(timeout_s=30.0)
    assert not outcome.committed and outcome.asked == 0
    assert outcome.describe(30.0) == (
        "requested, but no rank of the job is known to answer it: nothing awaited"
    )
    assert control.acknowledged(timeout_s=30.0) is False
    assert control.stacks([0], timeout_s=0.2) == {}
    assert time.monotonic() - started < 5.0


def test_a_commit_by_a_rank_behind_the_fastest_counts(collector: TestClient) -> None:
    # Rank 1 reported step 9 while rank 0, one process of its own, is at step 7: rank 0's
    # checkpoint at step 7, taken for the request, is its commit (it is after the request on
    # every rank that has got there; only a step before the slowest rank's is too old).
    now = time.time()
    _ingest(
        collector,
        *(schema.RankInfo(job_id="train", rank=r, node="n0", world_size=2) for r in (0, 1)),
        schema.StepRecord(job_id="train", rank=1, step=9, start_s=now, end_s=now),
        schema.Heartbeat(job_id="train", rank=0, time_s=now, last_step=7),
        schema.Heartbeat(job_id="train", rank=1, time_s=now, last_step=9),
    )
    control = CollectorControl(
        url="http://testserver", job_id="train", client=collector, poll_s=0.05
    )
    with Agents(collector, ["n0"], commit_step=7):
        outcome = control.request(timeout_s=10.0)
    assert (outcome.acked, outcome.asked, outcome.committed_step) == (2, 2, 7), outcome
    # Both ranks are at step 12 now: a commit reported at step 10, before the slowest rank's
    # step at the request, is an older save and not the request's commit.
    later = time.time()
    _ingest(
        collector,
        *(schema.Heartbeat(job_id="train", rank=r, time_s=later, last_step=12) for r in (0, 1)),
    )
    with Agents(collector, ["n0"], commit_step=10):
        assert control.request(timeout_s=0.5).committed_step is None
