"""`vigil controller --kubernetes` killed at each stage of a recovery and started again acts once:
one quarantine, one eviction, one JobSet restart, no pod back on the bad node."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.recovery.k8s.cluster import running
from tests.recovery.k8s.killed import STAGES, StubCollector, controller_command, killed_run
from vigil.env import EnvVar
from vigil.schema import Action, ActionState, Finding, FindingKind, FindingState


@pytest.mark.e2e
@pytest.mark.parametrize("stage", STAGES)
def test_killed_controller_acts_exactly_once(stage: str, tmp_path: Path) -> None:
    outcome = killed_run(stage, "training", tmp_path)
    assert outcome.first_exit == 70, "the first controller did not reach the stage"
    assert outcome.second_exit == 0
    assert (outcome.restarts, outcome.evictions, outcome.quarantines) == (1, 1, 1)
    assert outcome.pods_on_bad_node == 0


@pytest.mark.e2e
def test_cli_reports_a_jobset_without_the_preconditions_and_touches_nothing(
    tmp_path: Path,
) -> None:
    """`act` mode in an allowed namespace, a straggler served: the JobSet lacks the
    preconditions, so the command says what is missing and writes nothing at all."""
    with running("training", nodes=5, replicas=4, safe=False) as (cluster, fake):
        stub = StubCollector("node-1")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(cluster.kubeconfig())

        def finish_once_the_finding_was_read() -> None:
            deadline = time.time() + 60
            while stub.first_served_s is None and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # a few polls of the controller's loop after it
            fake.finish_generation = 0

        threading.Thread(target=finish_once_the_finding_was_read, daemon=True).start()
        env = {**os.environ, EnvVar.DATA_DIR.value: str(tmp_path / "data")}
        try:
            done = subprocess.run(
                controller_command(kubeconfig, stub.url, "training"),
                env=env, capture_output=True, timeout=120, check=False,
            )  # fmt: skip
        finally:
            stub.close()
        err = done.stderr.decode()
        assert done.returncode == 0, err[-2000:]
        assert "podFailurePolicy has no FailJob rule on the DisruptionTarget" in err
        assert "RestartJobSetAndIgnoreMaxRestarts" in err
        assert stub.first_served_s is not None  # it did look at the finding
        writes = [c for c in cluster.calls() if c.write and c.agent != "fake-jobset-controller"]
        assert writes == []
        # What it lacks is posted as one finding, each missing precondition its evidence.
        (unsafe,) = [
            r
            for r in stub.posted
            if isinstance(r, Finding) and r.kind is FindingKind.RECOVERY_UNSAFE
        ]
        assert unsafe.job_id == "train" and unsafe.state is FindingState.OPEN
        assert sorted(e.metric for e in unsafe.evidence) == [
            "job.backoff_limit.workers",
            "job.pod_failure_policy.workers",
            "jobset.failure_policy",
        ]
        assert all(e.note for e in unsafe.evidence)
        assert sorted(unsafe.subjects.nodes) == [f"node-{i}" for i in range(4)]
        # Nothing was carried out: every action it recorded says it was not allowed to act.
        actions = [r for r in stub.posted if isinstance(r, Action)]
        assert not [a for a in actions if a.state is ActionState.SUCCEEDED], actions
