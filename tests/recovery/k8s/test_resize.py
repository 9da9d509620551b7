"""No spare node for the pod of a quarantined node: the JobSet shrinks by that node where it
declares an elastic range (suspend -> patch parallelism/completions -> resume), otherwise it
stays where it runs, quarantined node and all, with the reason recorded and no restart loop.

On kmock's emulator with the fake JobSet controller of `cluster.py`, which lowers a Job's pods
when its parallelism goes down as JobSet's ElasticJobSet does (it does not check the feature
gate: a real API server without it refuses the patch, and vigil then resumes the JobSet as it
was). The pure half (`k8s_resize`) is tested at the end.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from kubernetes import client

from tests.recovery.k8s.cluster import JOBSET_API, TRAINJOB_API, Call, Cluster, jobset, running
from tests.recovery.k8s.test_recovery import NS, Once, executor, straggler
from vigil.recovery import controller, k8s_guard, k8s_journal, k8s_resize, k8s_restart
from vigil.schema import ActionKind, ActionState

ELASTIC = {k8s_resize.NNODES_ANNOTATION: "2:4"}


def jobset_writes(calls: list[Call]) -> list[str]:
    """vigil's writes to the JobSet and the nodes, in order (journal annotations left out)."""
    out = []
    for c in calls:
        if not c.write or c.agent != "vigil":
            continue
        if "/nodes/" in c.path:
            out.append(f"quarantine {c.path.split('/')[-1]}")
        elif c.subresource == "eviction":
            out.append("evict")
        elif "/jobsets/" in c.path:
            spec = (c.data or {}).get("spec") or {}
            if "suspend" in spec:
                out.append("suspend" if spec["suspend"] else "resume")
            elif "replicatedJobs" in spec:
                size = spec["replicatedJobs"][0]["template"]["spec"]["parallelism"]
                out.append(f"resize to {size}")
    return out


def _controller(cluster: Cluster, ex: Any, findings: Once) -> controller.Controller:
    layout = ex.placement()
    js = ex.read_jobset()
    return controller.Controller(
        config=controller.ControllerConfig(
            job_id="train",
            run_id="r",
            poll_interval_s=0.05,
            # As `vigil controller --kubernetes` sets it.
            min_dp_size=k8s_resize.policy_floor(js, pods=len(layout.active)),
            diagnose_timeout_s=5.0,
        ),
        executor=ex,
        journal=k8s_journal.AnnotationJournal(ex.store),
        placement=layout,
        findings=findings,
    )


def _jobset(cluster: Cluster) -> dict[str, Any]:
    custom = client.CustomObjectsApi(cluster.client("test"))
    return dict(custom.get_namespaced_custom_object(*JOBSET_API[:2], NS, JOBSET_API[2], "train"))


def test_no_spare_and_an_elastic_range_shrinks_the_jobset_off_the_bad_node() -> None:
    with running(NS, nodes=4, replicas=1, parallelism=4, annotations=ELASTIC) as (cluster, fake):
        ex = executor(cluster)
        ctl = _controller(cluster, ex, Once([straggler("node-1")]))
        assert ctl.config.min_dp_size == 2
        ctl._start_or_resume()
        ctl._step()
        resize = ctl.journal.get("straggler-node-1/2-resize")
        assert resize is not None and resize.state is ActionState.SUCCEEDED, resize
        assert resize.attempt == 1 and "world size 3" in resize.result
        # Quarantine first, then suspend, the smaller size, resume; nothing evicted.
        assert jobset_writes(cluster.calls()) == [
            "quarantine node-1",
            "suspend",
            "resize to 3",
            "resume",
        ]
        js = _jobset(cluster)
        spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert (spec["parallelism"], spec["completions"], js["spec"]["suspend"]) == (3, 3, False)
        # Three new pods, none on the quarantined node; the old four are gone.
        slots = ex.slots()
        assert len(slots) == 3 and "node-1" not in {s.node for s in slots}
        assert {n for _, _, n in fake.placed[4:]} == {"node-0", "node-2", "node-3"}
        assert ctl.placement.active == tuple(s.node for s in slots)
        # The resize is journaled on the job for a controller that replaces this one.
        assert ex.store.read()[k8s_resize.RESIZE_ANNOTATION] == "0:4:3"
        ctl._finish(0, "test over")


def test_no_spare_and_no_elastic_range_stays_quarantined_without_a_restart_loop() -> None:
    with running(NS, nodes=4, replicas=1, parallelism=4) as (cluster, _fake):
        ex = executor(cluster)
        before = {s.name for s in ex.slots()}
        findings = Once([straggler("node-1")])
        ctl = _controller(cluster, ex, findings)
        ctl._start_or_resume()
        ctl._step()
        resize = ctl.journal.get("straggler-node-1/2-resize")
        assert resize is not None and resize.state is ActionState.FAILED, resize
        assert resize.result.startswith("StayError: not restarting train")
        assert "no spare node is free and it declares no elastic node range" in resize.result
        # Quarantined (so nothing new lands there), and nothing restarted: same pods, same size.
        assert jobset_writes(cluster.calls()) == ["quarantine node-1"]
        assert {s.name for s in ex.slots()} == before
        # The straggler persists: a second finding changes nothing either.
        time.sleep(0.05)
        again_found = msgspec.structs.replace(
            straggler("node-1"), finding_id="straggler-node-1-again"
        )
        findings.findings, findings.sent = [again_found], False
        ctl._step()
        again = ctl.journal.get("straggler-node-1-again/2-resize")
        assert again is not None and again.state is ActionState.FAILED
        assert jobset_writes(cluster.calls()) == ["quarantine node-1"]
        assert {s.name for s in ex.slots()} == before
        assert not [a for a in ctl.journal.actions() if a.kind is ActionKind.RESTART]
        ctl._finish(0, "test over")


def test_a_resize_a_killed_controller_began_is_finished_once() -> None:
    with running(NS, nodes=4, replicas=1, parallelism=4, annotations=ELASTIC) as (cluster, _fake):
        ex = executor(cluster)
        ex.launch(ex.placement(), 0)
        # A controller journaled the resize and suspended the JobSet, then died.
        ex.store.write({k8s_resize.RESIZE_ANNOTATION: "0:4:3"})
        ex.api.patch_custom(JOBSET_API, NS, "train", {"spec": {"suspend": True}})
        successor = executor(cluster)
        successor.kill_attempt(0)
        successor.launch(successor.placement(timeout_s=10), 1)
        successor.kill_attempt(0)  # once more (restarted again): nothing to do
        assert jobset_writes(cluster.vigil_calls())[-3:] == ["suspend", "resize to 3", "resume"]
        assert jobset_writes(cluster.vigil_calls()).count("resize to 3") == 1
        assert len(successor.slots()) == 3
        assert k8s_restart.resize_record(successor) == (0, 4, 3)


def test_a_trainjob_with_no_spare_stays_its_num_nodes_being_immutable() -> None:
    with running(NS, nodes=4, replicas=4) as (cluster, fake):
        custom = client.CustomObjectsApi(cluster.client("fake-jobset-controller"))
        custom.create_namespaced_custom_object(
            *TRAINJOB_API[:2], NS, TRAINJOB_API[2],
            {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": "train", "namespace": NS}, "spec": {"suspend": False}},
        )  # fmt: skip
        fake.trainjob = True
        ex = executor(cluster, trainjob="train")
        ex.launch(ex.placement(), 0)
        ex.cordon("node-1")
        with pytest.raises(k8s_guard.StayError, match="numNodes is immutable"):
            ex.kill_attempt(0)
        assert not [c for c in cluster.vigil_calls() if "/trainjobs/" in c.path and c.write]
        assert len(ex.slots()) == 4


# -- the pure half ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"annotations": {k8s_resize.NNODES_ANNOTATION: "2:8"}}, (2, 8)),
        ({"args": ("--nnodes=3:4", "--nproc-per-node=8", "train.py")}, (3, 4)),
        ({"args": ("sh", "-c", "torchrun --nnodes 1:4 train.py")}, (1, 4)),
        ({"args": ("--nnodes=4", "train.py")}, None),  # a fixed size is no range
        ({}, None),
    ],
)
def test_the_elastic_range_is_read_from_the_annotation_or_torchruns_arguments(
    options: dict[str, Any], expected: tuple[int, int] | None
) -> None:
    assert k8s_resize.elastic_range(jobset("t", NS, replicas=1, parallelism=4, **options)) == (
        expected
    )


def test_torchruns_environment_names_the_range_too() -> None:
    js = jobset("t", NS, replicas=1, parallelism=4)
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container["containers"][0]["env"] = [{"name": "PET_NNODES", "value": "2:4"}]
    assert k8s_resize.elastic_range(js) == (2, 4)


def test_a_plan_says_why_a_jobset_cannot_shrink() -> None:
    elastic = jobset("t", NS, replicas=1, parallelism=4, annotations=ELASTIC)
    plan = k8s_resize.plan(elastic, pods=4)
    assert isinstance(plan, k8s_resize.ResizePlan) and (plan.from_pods, plan.to_pods) == (4, 3)
    jobs = k8s_resize.resized_jobs(elastic, plan)
    assert jobs[0]["template"]["spec"]["parallelism"] == jobs[0]["template"]["spec"]["completions"]
    assert elastic["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 4  # a copy
    assert "does not allow 1 node" in str(k8s_resize.plan(elastic, pods=4, drop=3))
    replicas = jobset("t", NS, replicas=4, annotations=ELASTIC)  # four one-pod Jobs
    assert "never replicas" in str(k8s_resize.plan(replicas, pods=4))
    assert "no elastic node range" in str(k8s_resize.plan(jobset("t", NS, replicas=4), pods=4))
    assert k8s_resize.policy_floor(elastic, pods=4) == 2
    assert k8s_resize.policy_floor(jobset("t", NS, replicas=4), pods=4) == 3
    assert k8s_resize.policy_floor(jobset("t", NS, replicas=1), pods=1) == 1
