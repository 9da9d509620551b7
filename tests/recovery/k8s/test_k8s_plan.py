"""The pure half of Kubernetes recovery: preconditions, rank order, spares, taints, the breaker."""

from __future__ import annotations

import pytest

from tests.recovery.k8s.cluster import _pod, jobset, node
from vigil.recovery import k8s_plan


def test_a_jobset_with_the_preconditions_has_no_problems() -> None:
    assert k8s_plan.precondition_problems(jobset("t", "ns", replicas=2)) == []


def test_each_missing_precondition_is_named() -> None:
    problems = k8s_plan.precondition_problems(jobset("t", "ns", replicas=2, safe=False))
    assert len(problems) == 3
    assert "backoffLimit is None, needs 0" in problems[0]
    assert "DisruptionTarget" in problems[1]
    assert "RestartJobSetAndIgnoreMaxRestarts" in problems[2]


def test_a_failure_policy_restarting_on_other_reasons_does_not_count() -> None:
    js = jobset("t", "ns", replicas=2)
    js["spec"]["failurePolicy"]["rules"][0]["onJobFailureReasons"] = ["BackoffLimitExceeded"]
    assert ["failurePolicy" in p for p in k8s_plan.precondition_problems(js)] == [True]


def test_pods_are_ordered_by_job_index_and_other_jobsets_pods_are_dropped() -> None:
    js = jobset("t", "ns", replicas=3)
    pods = [
        _pod("t", "ns", (2, 0), 0, "n2"),
        _pod("other", "ns", (0, 0), 0, "n9"),
        _pod("t", "ns", (0, 0), 0, "n0"),
    ]
    pods.append(_pod("t", "ns", (1, 0), 0, "n1"))
    slots = k8s_plan.pod_slots(js, pods)
    assert [(s.ordinal, s.node) for s in slots] == [(0, "n0"), (1, "n1"), (2, "n2")]


def test_a_disrupted_pod_is_seen_with_its_exit_code() -> None:
    pod = _pod("t", "ns", (0, 0), 3, "n0")
    pod["status"] = {
        "phase": "Failed",
        "conditions": [{"type": "DisruptionTarget", "status": "True"}],
        "containerStatuses": [{"state": {"terminated": {"exitCode": 137}}}],
    }
    (slot,) = k8s_plan.pod_slots(jobset("t", "ns", replicas=1), [pod])
    assert (slot.generation, slot.disrupted, slot.exit_code) == (3, True, 137)


def test_spares_are_schedulable_unused_nodes_matching_the_selector() -> None:
    tainted = node("n3", pool="gpu")
    tainted["spec"]["taints"] = [{"key": "nvidia.com/xid", "effect": "NoSchedule"}]
    not_ready = node("n4", pool="gpu")
    not_ready["status"]["conditions"][0]["status"] = "False"
    nodes = [
        node("n0", pool="gpu"),
        node("n1", pool="gpu"),
        node("n2", pool="cpu"),
        tainted,
        not_ready,
    ]
    assert k8s_plan.spare_nodes(nodes, ["n0"], {"pool": "gpu"}) == ["n1"]


def test_quarantine_keeps_other_tools_taints_and_records_them_as_evidence() -> None:
    n = node("n0")
    n["spec"]["taints"] = [{"key": "nvidia.com/xid", "value": "79", "effect": "NoExecute"}]
    n["status"]["conditions"].append({"type": "GpuHealthy", "status": "True"})
    n["status"]["conditions"].append({"type": "MemoryPressure", "status": "True"})
    taints = k8s_plan.with_quarantine(n["spec"]["taints"], "recovery")
    assert [t["key"] for t in taints] == ["nvidia.com/xid", k8s_plan.QUARANTINE_TAINT]
    assert k8s_plan.with_quarantine(taints, "again") == [taints[0], {**taints[1], "value": "again"}]
    evidence = k8s_plan.evidence_of(n)
    assert "taint nvidia.com/xid=79:NoExecute" in evidence and "MemoryPressure=True" in evidence


def test_breaker_counts_nodes_and_share_within_the_window() -> None:
    limits = k8s_plan.BreakerLimits(max_nodes=2, max_fraction=0.25, window_s=600)
    assert k8s_plan.breaker_refusal([], now_s=1000, total_nodes=4, limits=limits) == ""
    assert "limit 2" in k8s_plan.breaker_refusal(
        [900, 950], now_s=1000, total_nodes=100, limits=limits
    )
    # Quarantines older than the window no longer count.
    assert k8s_plan.breaker_refusal([100, 200], now_s=1000, total_nodes=100, limits=limits) == ""
    # Two of four nodes is 50 %: past the share even below the count.
    assert "exceeds 25%" in k8s_plan.breaker_refusal(
        [950], now_s=1000, total_nodes=4, limits=limits
    )
    with pytest.raises(ValueError, match="max_fraction"):
        k8s_plan.BreakerLimits(max_fraction=1.5)


def test_attempt_generation_map_round_trips() -> None:
    mapping = {0: 3, 1: 4, 2: 7}
    assert k8s_plan.parse_generation_map(k8s_plan.format_generation_map(mapping)) == mapping
    assert k8s_plan.parse_generation_map("") == {}
