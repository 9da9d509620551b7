"""The controller with the Kubernetes executor, on kmock's emulator and a fake JobSet controller.

Each case asserts what a cluster operator would see: the order of vigil's writes in the
emulator's request history, where the recreated pods landed, and the controller's record.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client

from tests.recovery.k8s.cluster import JOBSET_API, TRAINJOB_API, Call, Cluster, running
from vigil import codec
from vigil.recovery import controller, k8s_executor, k8s_journal, k8s_plan, k8s_resize
from vigil.recovery import kubernetes as kube
from vigil.schema import (
    ActionKind,
    ActionState,
    DiagResult,
    Evidence,
    Finding,
    FindingKind,
    Subjects,
    Verdict,
)

NS = "training"


@dataclass
class Once:
    """A finding source that reports each finding once, stamped when first fetched."""

    findings: list[Finding]
    sent: bool = False

    def fetch(self) -> Sequence[Finding]:
        if self.sent:
            return []
        self.sent = True
        now = time.time()
        import msgspec

        return [
            msgspec.structs.replace(f, detected_s=now, trace_start_s=now) for f in self.findings
        ]


@dataclass
class SdkCheckpoint:
    """Stands in for the job's checkpoint: it leaves a ConfigMap, so the emulator's history
    shows when the checkpoint was taken relative to vigil's writes."""

    cluster: Cluster
    taken: list[float] = field(default_factory=list)

    def request(self, *, timeout_s: float) -> controller.CheckpointOutcome:
        core = client.CoreV1Api(self.cluster.client("test-sdk"))
        core.create_namespaced_config_map(
            NS, {"metadata": {"name": f"ckpt-{len(self.taken)}", "namespace": NS}}
        )
        self.taken.append(time.time())
        return controller.CheckpointOutcome(acked=4, asked=4, committed_step=len(self.taken))


def straggler(node: str, slowdown: float = 2.0) -> Finding:
    return Finding(
        finding_id=f"straggler-{node}",
        kind=FindingKind.STRAGGLER,
        job_id="train",
        subjects=Subjects(nodes=[node]),
        evidence=[Evidence(metric="slowdown", observed=slowdown)],
        confidence=0.9,
    )


def hang() -> Finding:
    return Finding(
        finding_id="hang-1",
        kind=FindingKind.HANG,
        job_id="train",
        subjects=Subjects(ranks=[2]),
        confidence=0.9,
    )


def executor(
    cluster: Cluster, *, mode: str = "act", store: Any = None, **kw: Any
) -> k8s_executor.KubernetesExecutor:
    api = kube.Api(cluster.client())
    return k8s_executor.KubernetesExecutor(
        api=api,
        namespace=NS,
        jobset=kw.pop("jobset", "train"),
        mode=mode,
        allowed_namespaces=frozenset({NS}),
        store=store if store is not None else kube.JobSetAnnotations(api, NS, "train"),
        **{"poll_s": 0.02, "restart_timeout_s": 20.0, **kw},
    )


def run_controller(
    cluster: Cluster,
    ex: k8s_executor.KubernetesExecutor,
    findings: list[Finding],
    checkpointer: Any = None,
    checkpoint_timeout_s: float = 60.0,
) -> tuple[int, k8s_journal.AnnotationJournal]:
    book = k8s_journal.AnnotationJournal(ex.store)
    layout = ex.placement()
    ctl = controller.Controller(
        config=controller.ControllerConfig(
            job_id="train",
            run_id="r1",
            poll_interval_s=0.05,
            hang_confirm_s=0.0,
            # As `vigil controller --kubernetes` sets it.
            min_dp_size=k8s_resize.policy_floor(ex.read_jobset(), pods=len(layout.active)),
            diagnose_timeout_s=20.0,
            checkpoint_timeout_s=checkpoint_timeout_s,
        ),
        executor=ex,
        journal=book,
        placement=layout,
        findings=Once(findings),
        checkpointer=checkpointer,
    )
    return ctl.run(), book


def writes(calls: list[Call]) -> list[str]:
    """vigil's and the SDK's writes as short labels, in order (journal annotations left out)."""
    out = []
    for c in calls:
        if not c.write or c.agent not in ("vigil", "test-sdk"):
            continue
        if "/configmaps" in c.path:
            out.append("checkpoint")
        elif c.subresource == "eviction":
            out.append(f"evict {c.path.split('/')[-2]}")
        elif "/nodes/" in c.path:
            out.append(f"quarantine {c.path.split('/')[-1]}")
        elif "/jobs" in c.path and c.method == "POST":
            out.append("diagnose")
        elif "/trainjobs/" in c.path:
            spec = (c.data or {}).get("spec", {})
            out.append(
                "suspend"
                if spec.get("suspend") is True
                else "resume"
                if spec.get("suspend") is False
                else "runtimePatches"
            )
    return out


def test_straggler_is_checkpointed_quarantined_evicted_and_recreated_off_its_node() -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, fake):
        cluster.diag_logs["node-1"] = codec.encode_json(
            DiagResult(
                node="node-1",
                device="cuda:0",
                test="gemm.tflops",
                value=310.0,
                verdict=Verdict.FAIL,
            )
        ).decode()
        fake.finish_generation = 1
        cluster.fail("PATCH", "/nodes/node-1", 409)  # a conflicting node update: retried
        cluster.fail("POST", "/eviction", 429)  # a PodDisruptionBudget says not now: retried
        ex = executor(cluster)
        code, book = run_controller(cluster, ex, [straggler("node-1")], SdkCheckpoint(cluster))
        assert code == 0
        order = writes(cluster.calls())
        (evicted,) = {w for w in order if w.startswith("evict train-workers-1-0-g0-")}
        # Checkpoint first, then the node is fenced off before the pod is evicted (twice each:
        # the injected 409 and 429 are retried, and change nothing).
        assert order.index("checkpoint") < order.index("quarantine node-1") < order.index(evicted)
        assert order.count("quarantine node-1") == 2 and order.count(evicted) == 2
        # The recreated generation avoids the quarantined node and uses the spare.
        gen1 = {node for g, _, node in fake.placed if g == 1}
        assert "node-1" not in gen1 and "node-4" in gen1
        node = client.CoreV1Api(cluster.client()).read_node("node-1")
        assert node.spec.unschedulable is True
        assert [t.key for t in node.spec.taints] == [k8s_plan.QUARANTINE_TAINT]
        migrate = book.get("straggler-node-1/2-migrate")
        assert (
            migrate is not None and migrate.state is ActionState.SUCCEEDED and migrate.attempt == 1
        )
        # The diagnosis ran as a Job pinned to node-1, and its verdict is on the record.
        diagnose = book.get("straggler-node-1/1-diagnose")
        assert diagnose is not None and "node-1: fail" in diagnose.result
        js = client.CustomObjectsApi(cluster.client()).get_namespaced_custom_object(
            *JOBSET_API[:2], NS, JOBSET_API[2], "train"
        )
        assert js["status"]["restarts"] == 1


def test_hang_dumps_stacks_then_restarts_in_place() -> None:
    with running(NS, nodes=4, replicas=4) as (cluster, fake):
        fake.finish_generation = 1
        dumped: list[str] = []

        def pod_exec(pod: str, command: list[str]) -> str:
            dumped.append(pod)
            return "Thread 1 (idle)\n    wait (torch/distributed.py:100)\n"

        ex = executor(cluster, pod_exec=pod_exec)
        code, book = run_controller(cluster, ex, [hang()])
        assert code == 0
        assert sorted(d.rsplit("-", 1)[0] for d in dumped) == [
            f"train-workers-{i}-0-g0" for i in range(4)
        ]
        stacks = book.get("hang-1/0-dump_stacks")
        restart = book.get("hang-1/1-restart")
        assert (
            stacks is not None
            and stacks.state is ActionState.SUCCEEDED
            and "4 stacks" in stacks.result
        )
        assert restart is not None and restart.state is ActionState.SUCCEEDED
        assert stacks.end_s <= restart.start_s
        order = writes(cluster.calls())
        assert [w.rsplit("-", 1)[0] for w in order if w.startswith(("evict", "quarantine"))] == [
            "evict train-workers-0-0-g0"
        ]


def test_no_spare_and_jobs_that_cannot_shrink_stay_on_their_nodes() -> None:
    """Four one-pod Jobs with an elastic range: JobSet can change a Job's parallelism, never its
    replicas, so with no spare the job stays (the straggler's node quarantined), unrestarted."""
    elastic = {k8s_resize.NNODES_ANNOTATION: "2:4"}
    with running(NS, nodes=4, replicas=4, annotations=elastic) as (cluster, fake):
        ex = executor(cluster)
        book = k8s_journal.AnnotationJournal(ex.store)
        layout = ex.placement()
        ctl = controller.Controller(
            config=controller.ControllerConfig(
                job_id="train",
                run_id="r",
                poll_interval_s=0.05,
                min_dp_size=k8s_resize.policy_floor(ex.read_jobset(), pods=4),
            ),
            executor=ex,
            journal=book,
            placement=layout,
            findings=Once([straggler("node-1")]),
        )
        ctl._start_or_resume()
        ctl._step()
        resize = book.get("straggler-node-1/2-resize")
        assert resize is not None and resize.state is ActionState.FAILED, resize
        assert "never replicas" in resize.result and "the job stays on its nodes" in resize.result
        assert [w for w in writes(cluster.calls()) if w.startswith(("quarantine", "evict"))] == [
            "quarantine node-1"
        ]
        assert {g for g, _, _ in fake.placed} == {0}  # nothing recreated
        ctl._finish(0, "test over")


def test_circuit_breaker_stops_quarantine_and_the_restart() -> None:
    with running(NS, nodes=6, replicas=3) as (cluster, _fake):
        core = client.CoreV1Api(cluster.client("other-tool"))
        now = time.time()
        for name in ("node-4", "node-5"):  # two nodes vigil quarantined minutes ago
            core.patch_node(
                name,
                {
                    "metadata": {"annotations": {k8s_plan.QUARANTINED_AT: f"{now - 60:.0f}"}},
                    "spec": {
                        "taints": [
                            {
                                "key": k8s_plan.QUARANTINE_TAINT,
                                "value": "recovery",
                                "effect": "NoSchedule",
                            }
                        ]
                    },
                },
            )
        spare = client.CoreV1Api(cluster.client()).list_node().items
        assert len(spare) == 6
        core.create_node(
            {
                "metadata": {"name": "node-6"},
                "spec": {},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
        )
        ex = executor(cluster)
        findings = [straggler("node-1")]
        layout = ex.placement()
        assert layout.spares == ("node-3", "node-6")
        book = k8s_journal.AnnotationJournal(ex.store)
        ctl = controller.Controller(
            config=controller.ControllerConfig(
                job_id="train", run_id="r", poll_interval_s=0.05, min_dp_size=3
            ),
            executor=ex,
            journal=book,
            placement=layout,
            findings=Once(findings),
        )
        ctl._start_or_resume()
        ctl._step()
        migrate = book.get("straggler-node-1/2-migrate")
        assert migrate is not None and migrate.state is ActionState.FAILED, [
            (a.action_id, a.state, a.result) for a in book.actions()
        ]
        assert "circuit breaker open" in migrate.result
        assert not [w for w in writes(cluster.calls()) if w.startswith(("quarantine", "evict"))]
        ctl._finish(0, "test over")


def test_observe_mode_changes_nothing() -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, fake):
        ex = executor(cluster, mode="observe", store=k8s_journal.MemoryStore())
        before = len(cluster.vigil_calls())
        fake.finish_generation = None
        book = k8s_journal.AnnotationJournal(ex.store)
        ctl = controller.Controller(
            config=controller.ControllerConfig(
                job_id="train", run_id="r", poll_interval_s=0.05, min_dp_size=4
            ),
            executor=ex,
            journal=book,
            placement=ex.placement(),
            findings=Once([straggler("node-1")]),
        )
        ctl._start_or_resume()
        ctl._step()
        time.sleep(0.3)  # let the background diagnosis be refused
        ctl._step()
        assert [c for c in cluster.vigil_calls()[before:] if c.write] == []
        migrate = book.get("straggler-node-1/2-migrate")
        assert migrate is not None and migrate.state is ActionState.FAILED
        assert migrate.result.startswith("NotActingError: would taint vigil.dev/quarantine")
        assert "observe mode" in migrate.result


def test_jobset_without_the_preconditions_is_reported_not_touched() -> None:
    with running(NS, nodes=5, replicas=4, safe=False) as (cluster, _fake):
        ex = executor(cluster)
        assert not ex.acting
        assert any("DisruptionTarget" in p for p in ex.problems)
        assert any("RestartJobSetAndIgnoreMaxRestarts" in p for p in ex.problems)
        assert any("backoffLimit" in p for p in ex.problems)
        with pytest.raises(k8s_executor.NotActingError, match="podFailurePolicy"):
            ex.cordon("node-1")
        with pytest.raises(k8s_executor.NotActingError):
            ex.kill_attempt(0)
        assert [c for c in cluster.vigil_calls() if c.write] == []


def test_trainjob_is_suspended_patched_and_resumed() -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, fake):
        custom = client.CustomObjectsApi(cluster.client("fake-jobset-controller"))
        custom.create_namespaced_custom_object(
            *TRAINJOB_API[:2], NS, TRAINJOB_API[2],
            {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": "train", "namespace": NS}, "spec": {"suspend": False}},
        )  # fmt: skip
        fake.finish_generation = None
        fake.trainjob = True
        ex = executor(cluster, trainjob="train")
        layout = ex.placement()
        ex.launch(layout, 0)
        ex.cordon("node-1")
        ex.kill_attempt(0)
        ex.launch(layout, 1)
        order = writes(cluster.calls())
        assert order == ["quarantine node-1", "suspend", "runtimePatches", "resume"]
        tj = custom.get_namespaced_custom_object(*TRAINJOB_API[:2], NS, TRAINJOB_API[2], "train")
        (patch,) = tj["spec"]["runtimePatches"]
        assert patch["manager"] == k8s_plan.RUNTIME_PATCH_MANAGER
        assert "node-1" not in set(ex.placement().active)


def test_kueue_managed_trainjob_is_never_suspended() -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, _fake):
        custom = client.CustomObjectsApi(cluster.client("fake-jobset-controller"))
        custom.create_namespaced_custom_object(
            *TRAINJOB_API[:2], NS, TRAINJOB_API[2],
            {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": "train", "namespace": NS, "labels": {k8s_plan.KUEUE_QUEUE: "q"}},
             "spec": {"suspend": False}},
        )  # fmt: skip
        ex = executor(cluster, trainjob="train")
        assert any("Kueue" in p for p in ex.problems)
        with pytest.raises(k8s_executor.NotActingError):
            ex.kill_attempt(0)
        assert "suspend" not in writes(cluster.calls())


def test_a_second_controller_waits_for_the_lease() -> None:
    cluster = Cluster()
    try:
        first = kube.Lease(api=kube.Api(cluster.client()), namespace=NS, duration_s=2)
        second = kube.Lease(api=kube.Api(cluster.client()), namespace=NS, duration_s=2)
        assert first.acquire() and not second.acquire()
        assert first.acquire()  # renewing its own
        time.sleep(2.2)  # the first stopped renewing: its Lease expires
        assert second.acquire()
        with pytest.raises(kube.LeaseLostError):
            first._renewed_s = 0.0
            first.renew()
    finally:
        cluster.close()


def test_node_lost_the_jobset_restarts_itself_and_the_controller_follows_without_evicting() -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, fake):
        fake.finish_generation = 1
        ex = executor(cluster)
        layout = ex.placement()
        book = k8s_journal.AnnotationJournal(ex.store)
        ctl = controller.Controller(
            config=controller.ControllerConfig(
                job_id="train", run_id="r", poll_interval_s=0.05, min_dp_size=4
            ),
            executor=ex,
            journal=book,
            placement=layout,
        )
        ctl._start_or_resume()
        # The node lifecycle controller: node-2 unreachable (tainted), its pod failed with the
        # DisruptionTarget condition.
        other = client.CoreV1Api(cluster.client("node-lifecycle"))
        unreachable = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
        other.patch_node("node-2", {"spec": {"taints": [unreachable]}})
        pod = next(p for p in other.list_namespaced_pod(NS).items if p.spec.node_name == "node-2")
        other.patch_namespaced_pod(
            pod.metadata.name,
            NS,
            {
                "status": {
                    "phase": "Failed",
                    "conditions": [{"type": "DisruptionTarget", "status": "True"}],
                }
            },
        )
        while not ctl.state.finished:
            ctl._step()
            time.sleep(0.05)
        assert ctl.state.exit_code == 0
        (restart,) = [a for a in book.actions() if a.kind is ActionKind.RESTART]
        assert restart.state is ActionState.SUCCEEDED and restart.attempt == 1
        assert not [w for w in writes(cluster.calls()) if w.startswith(("evict", "quarantine"))]
        assert "node-2" not in {n for g, _, n in fake.placed if g == 1}


def test_a_restart_the_jobset_made_by_itself_before_a_poll_is_followed_not_repeated() -> None:
    with running(NS, nodes=5, replicas=4) as (cluster, fake):
        ex = executor(cluster)
        book = k8s_journal.AnnotationJournal(ex.store)
        ctl = controller.Controller(
            config=controller.ControllerConfig(
                job_id="train", run_id="r", poll_interval_s=0.05, min_dp_size=4
            ),
            executor=ex,
            journal=book,
            placement=ex.placement(),
        )
        ctl._start_or_resume()
        other = client.CoreV1Api(cluster.client("kubelet"))
        pod = other.list_namespaced_pod(NS).items[0]
        other.patch_namespaced_pod(pod.metadata.name, NS, {"status": {"phase": "Failed"}})
        custom = client.CustomObjectsApi(cluster.client())
        while (
            custom.get_namespaced_custom_object(*JOBSET_API[:2], NS, JOBSET_API[2], "train")[
                "status"
            ]["restarts"]
            < 1
        ):
            time.sleep(0.02)  # the JobSet restarts before the controller looks
        fake.finish_generation = 1
        while not ctl.state.finished:
            ctl._step()
            time.sleep(0.05)
        (restart,) = [a for a in book.actions() if a.kind is ActionKind.RESTART]
        assert restart.state is ActionState.SUCCEEDED and restart.attempt == 1
        js = custom.get_namespaced_custom_object(*JOBSET_API[:2], NS, JOBSET_API[2], "train")
        assert js["status"]["restarts"] == 1
        assert not [w for w in writes(cluster.calls()) if w.startswith("evict")]
