"""`advise` mode on kmock's emulator with a real collector app (in process): each change the
controller would make is posted as a `proposed` action and made only after a person approves it
through the collector's API; unapproved, nothing in the cluster changes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.recovery.k8s.cluster import running
from tests.recovery.k8s.test_recovery import NS, Once, executor, hang, run_controller, writes
from vigil.collector import CollectorSettings, create_app
from vigil.recovery import controller, k8s_journal
from vigil.recovery.collector_link import CollectorActions, CollectorApprovals
from vigil.schema import Action, ActionKind, ActionState

URL = "http://testserver"


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[TestClient]:
    settings = CollectorSettings(data_dir=tmp_path, store_url=f"sqlite:///{tmp_path / 's.db'}")
    with TestClient(create_app(settings)) as c:
        yield c


def _approvals(collector: TestClient, tmp_path: Path) -> CollectorApprovals:
    sink = CollectorActions(url=URL, client=collector, spool_dir=tmp_path / "spool")
    return CollectorApprovals(url=URL, actions=sink, client=collector, poll_s=0.05)


def _proposed(collector: TestClient) -> list[dict[str, object]]:
    rows = collector.get("/api/v1/actions", params={"job_id": "train"}).json()
    return [r for r in rows if r["state"] == "proposed"]


def test_a_restart_waits_for_a_persons_approval(collector: TestClient, tmp_path: Path) -> None:
    with running(NS, nodes=4, replicas=4) as (cluster, fake):
        fake.finish_generation = 1
        ex = executor(
            cluster, mode="advise", pod_exec=lambda pod, cmd: "Thread 1\n",
            approvals=_approvals(collector, tmp_path), approval_timeout_s=30.0,
        )  # fmt: skip
        seen_before: list[list[str]] = []
        approved: list[str] = []

        def person() -> None:
            deadline = time.monotonic() + 30
            while not approved and time.monotonic() < deadline:
                for row in _proposed(collector):
                    seen_before.append(writes(cluster.calls()))
                    action_id = str(row["action_id"])
                    r = collector.post(f"/api/v1/actions/{action_id}/approve")
                    assert r.status_code == 200 and r.json()["state"] == "approved", r.text
                    approved.append(action_id)
                time.sleep(0.05)

        thread = threading.Thread(target=person)
        thread.start()
        code, book = run_controller(cluster, ex, [hang()])
        thread.join(30)
        assert code == 0 and len(approved) == 1
        # The proposal was there, and nothing evicted, before the approval.
        assert not any(w.startswith("evict") for w in seen_before[0])
        assert any(w.startswith("evict") for w in writes(cluster.calls()))
        restart = book.get("hang-1/1-restart")
        assert restart is not None and restart.state is ActionState.SUCCEEDED
        row = collector.get(f"/api/v1/actions/{approved[0]}/approval").json()
        assert row["state"] == "approved" and row["kind"] == "restart"
        assert "evict pod train-workers-0-0-g0" in str(row["result"])
        # Approving twice is fine; approving what was never proposed is refused.
        assert collector.post(f"/api/v1/actions/{approved[0]}/approve").status_code == 200
        assert collector.post("/api/v1/actions/nope/approve").status_code == 404
        finished = Action(
            action_id="train/done-1",
            kind=ActionKind.RESTART,
            job_id="train",
            target="x",
            state=ActionState.SUCCEEDED,
        )
        _approvals(collector, tmp_path).actions.publish(finished)
        done = collector.post("/api/v1/actions/train/done-1/approve")
        assert done.status_code == 409 and "succeeded" in done.json()["detail"]


def test_unapproved_nothing_changes(collector: TestClient, tmp_path: Path) -> None:
    with running(NS, nodes=4, replicas=4) as (cluster, fake):
        fake.finish_generation = None
        ex = executor(
            cluster, mode="advise", store=k8s_journal.MemoryStore(),
            approvals=_approvals(collector, tmp_path), approval_timeout_s=0.3,
        )  # fmt: skip
        before = len(cluster.vigil_calls())
        book = k8s_journal.AnnotationJournal(ex.store)
        ctl = controller.Controller(
            config=controller.ControllerConfig(
                job_id="train", run_id="r", poll_interval_s=0.05, min_dp_size=4, hang_confirm_s=0
            ),
            executor=ex,
            journal=book,
            placement=ex.placement(),
            findings=Once([hang()]),
        )
        ctl._start_or_resume()
        ctl._step()
        assert [c for c in cluster.vigil_calls()[before:] if c.write] == []
        restart = book.get("hang-1/1-restart")
        assert restart is not None and restart.state is ActionState.FAILED
        assert "not approved within 0 s" in restart.result
        assert [r["kind"] for r in _proposed(collector)] == ["restart"]


def test_advise_without_a_collector_is_refused_before_touching_the_cluster() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VIGIL_COLLECTOR_URL"}
    cmd = [sys.executable, "-m", "vigil", "controller", "--kubernetes", "--jobset", "train",
           "--namespace", NS, "--mode", "advise", "--kubeconfig", "/nonexistent"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "advise mode needs a collector" in done.stderr
