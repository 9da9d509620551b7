"""Kubernetes recovery, the pure part: JobSet preconditions, rank -> pod -> node, the breaker.

Everything here reads plain dicts (the API server's JSON) and returns plain values (also the
diagnostics Job and a TrainJob's runtime patch that vigil writes, and the diagnostics' parsed
log); no
API calls, no clock, no `kubernetes` import (import-linter: only `vigil.recovery.kubernetes`
talks to a cluster). The label keys are the JobSet controller's (sigs.k8s.io/jobset
`api/jobset/v1alpha2/jobset_types.go`, `pkg/constants`) and the Job controller's.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vigil import codec
from vigil.schema import MAX_EVIDENCE, DiagResult, Evidence, Finding, FindingKind, Subjects

# The JobSet controller's labels on its Jobs and pods.
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
# status.restarts at the time the Job was created: the JobSet's restart generation.
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
# An Indexed Job's pod index (batch/v1).
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# Kueue owns suspend on jobs with this label: never toggle it there.
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
# A TrainJob's JobSet carries the TrainJob's name in this label (Kubeflow Trainer v2).
TRAINJOB_NAME = "trainer.kubeflow.org/trainjob-name"

# vigil's own keys.
QUARANTINE_TAINT = "vigil.dev/quarantine"
QUARANTINED_AT = "vigil.dev/quarantined-at"
QUARANTINE_JOB = "vigil.dev/quarantine-job"
QUARANTINE_EVIDENCE = "vigil.dev/quarantine-evidence"
JOURNAL_ACTIONS = "vigil.dev/journal-actions"
JOURNAL_STATE = "vigil.dev/journal-state"
# "<attempt> <restart generation>": the JobSet generation each controller attempt runs as.
ATTEMPT_GENERATION = "vigil.dev/attempt-generation"
RUNTIME_PATCH_MANAGER = "vigil.dev/recovery"

RESTART_ACTION = "RestartJobSetAndIgnoreMaxRestarts"


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("labels") or {})


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("annotations") or {})


def kueue_managed(obj: Mapping[str, Any]) -> bool:
    """Kueue admits this job by toggling suspend itself: vigil must never touch suspend."""
    return KUEUE_QUEUE in _labels(obj)


@dataclass(frozen=True)
class Gap:
    """One missing precondition: a stable key (the Finding evidence's metric), the value found
    and the one needed (as numbers, for the evidence), and what to change, in words."""

    key: str
    found: float
    needed: float
    message: str


def precondition_gaps(jobset: Mapping[str, Any]) -> list[Gap]:
    """What keeps vigil from restarting this JobSet safely by evicting one pod ([] = none).

    Needed: every replicated Job's template has `backoffLimit: 0` and a `podFailurePolicy`
    rule `FailJob` on the pod condition `DisruptionTarget` (so an eviction fails the whole Job
    instead of the Job quietly replacing one pod), and the JobSet's `failurePolicy` has a rule
    mapping `PodFailurePolicy` failures to `RestartJobSetAndIgnoreMaxRestarts` (a
    vigil-initiated restart recreates every Job without spending `maxRestarts`)."""
    spec = jobset.get("spec") or {}
    gaps: list[Gap] = []
    replicated = spec.get("replicatedJobs") or []
    if not replicated:
        gaps.append(Gap("jobset.replicated_jobs", 0, 1, "spec.replicatedJobs is empty"))
    for rj in replicated:
        name = rj.get("name", "?")
        job_spec = (rj.get("template") or {}).get("spec") or {}
        limit = job_spec.get("backoffLimit")
        if limit != 0:
            gaps.append(
                Gap(
                    f"job.backoff_limit.{name}",
                    float(limit) if isinstance(limit, int) else -1.0,
                    0,
                    f"replicatedJob {name}: backoffLimit is {limit!r}, needs 0",
                )
            )
        rules = (job_spec.get("podFailurePolicy") or {}).get("rules") or []
        if not any(
            r.get("action") == "FailJob"
            and any(p.get("type") == "DisruptionTarget" for p in r.get("onPodConditions") or [])
            for r in rules
        ):
            gaps.append(
                Gap(
                    f"job.pod_failure_policy.{name}",
                    0,
                    1,
                    f"replicatedJob {name}: podFailurePolicy has no FailJob rule on the "
                    "DisruptionTarget pod condition",
                )
            )
    rules = (spec.get("failurePolicy") or {}).get("rules") or []
    if not any(
        r.get("action") == RESTART_ACTION
        and "PodFailurePolicy" in (r.get("onJobFailureReasons") or [])
        for r in rules
    ):
        gaps.append(
            Gap(
                "jobset.failure_policy",
                0,
                1,
                f"failurePolicy has no rule mapping onJobFailureReasons [PodFailurePolicy] to "
                f"{RESTART_ACTION}",
            )
        )
    return gaps


def precondition_problems(jobset: Mapping[str, Any]) -> list[str]:
    """`precondition_gaps` in words ([] = vigil may restart the JobSet)."""
    return [g.message for g in precondition_gaps(jobset)]


def kueue_gap(trainjob: str) -> Gap:
    return Gap(
        "trainjob.kueue_managed",
        1,
        0,
        f"TrainJob {trainjob} is Kueue-managed ({KUEUE_QUEUE}): vigil never toggles its suspend",
    )


def unsafe_finding(
    job_id: str, target: str, gaps: Sequence[Gap], *, nodes: Sequence[str], now_s: float
) -> Finding:
    """The finding vigil posts instead of acting on a job it cannot restart safely: one
    evidence entry per missing precondition; its id is stable for the same job and gaps (a
    restarted controller posts the same finding again, upserted by id)."""
    keys = ",".join(sorted(g.key for g in gaps))
    digest = hashlib.sha1(f"{job_id}|{keys}".encode(), usedforsecurity=False).hexdigest()[:12]
    return Finding(
        finding_id=f"recovery-unsafe-{digest}",
        kind=FindingKind.RECOVERY_UNSAFE,
        job_id=job_id,
        subjects=Subjects(nodes=sorted(set(nodes))),
        summary=(
            f"vigil will not restart {target}: {len(gaps)} precondition(s) missing "
            "(see README, Recovery on Kubernetes); nothing in the cluster is changed"
        ),
        evidence=[
            Evidence(metric=g.key, observed=g.found, baseline=g.needed, note=g.message)
            for g in gaps[:MAX_EVIDENCE]
        ],
        confidence=1.0,
        detected_s=now_s,
    )


@dataclass(frozen=True)
class PodSlot:
    """One pod of the job: its ordinal (job index x pods per Job + completion index), name,
    node, phase and restart generation."""

    ordinal: int
    name: str
    node: str
    phase: str
    generation: int
    disrupted: bool
    deleting: bool
    exit_code: int | None


def pods_per_job(jobset: Mapping[str, Any]) -> dict[str, int]:
    """Pods each replicated Job runs (its parallelism, else completions, else 1)."""
    out: dict[str, int] = {}
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        job_spec = (rj.get("template") or {}).get("spec") or {}
        out[str(rj.get("name"))] = int(
            job_spec.get("parallelism") or job_spec.get("completions") or 1
        )
    return out


def total_pods(jobset: Mapping[str, Any]) -> int:
    """Pods the JobSet runs when every Job is up (replicas x pods per Job, summed)."""
    per_job = pods_per_job(jobset)
    return sum(
        per_job[str(rj.get("name"))] * int(rj.get("replicas") or 1)
        for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []
    )


def pod_slots(jobset: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[PodSlot]:
    """The JobSet's pods in rank order. Filters by the JobSet's name label itself (a list by
    label selector may return more than asked: a server or proxy that ignores selectors)."""
    name = jobset.get("metadata", {}).get("name")
    per_job = pods_per_job(jobset)
    # Replicated Jobs stack in spec order: the first's pods take the lowest ordinals.
    offsets: dict[str, int] = {}
    total = 0
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        offsets[str(rj.get("name"))] = total
        total += per_job[str(rj.get("name"))] * int(rj.get("replicas") or 1)
    slots = []
    for pod in pods:
        labels = _labels(pod)
        if labels.get(JOBSET_NAME) != name:
            continue
        rj = labels.get(REPLICATED_JOB, next(iter(offsets), ""))
        try:
            index = int(labels.get(JOB_INDEX, "0"))
            completion = int(
                labels.get(COMPLETION_INDEX) or annotations_of(pod).get(COMPLETION_INDEX, "0")
            )
            generation = int(labels.get(RESTART_ATTEMPT, "0"))
        except ValueError:
            continue
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        exit_code = None
        for cs in status.get("containerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated")
            if terminated is not None:
                exit_code = int(terminated.get("exitCode", 1))
        slots.append(
            PodSlot(
                ordinal=offsets.get(rj, 0) + index * per_job.get(rj, 1) + completion,
                name=str(pod["metadata"]["name"]),
                node=str((pod.get("spec") or {}).get("nodeName") or ""),
                phase=str(status.get("phase") or "Pending"),
                generation=generation,
                disrupted=any(
                    c.get("type") == "DisruptionTarget" and c.get("status") == "True"
                    for c in conditions
                ),
                deleting=bool(pod["metadata"].get("deletionTimestamp")),
                exit_code=exit_code,
            )
        )
    return sorted(slots, key=lambda s: (s.generation, s.ordinal))


def generation_of(jobset: Mapping[str, Any]) -> int:
    """The JobSet's current restart generation (status.restarts)."""
    return int((jobset.get("status") or {}).get("restarts") or 0)


def node_blocked(node: Mapping[str, Any]) -> str:
    """Why the scheduler would not place a new pod on `node` ("" = it would)."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return "cordoned"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute"):
            return f"taint {taint.get('key')}"
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") != "True":
            return "not Ready"
    return ""


def spare_nodes(
    nodes: Iterable[Mapping[str, Any]], used: Iterable[str], selector: Mapping[str, str]
) -> list[str]:
    """Nodes a recreated pod could land on: schedulable, not already running the job, and
    carrying the pod template's nodeSelector labels."""
    taken = set(used)
    out = []
    for node in nodes:
        name = node["metadata"]["name"]
        labels = _labels(node)
        if name in taken or node_blocked(node):
            continue
        if all(labels.get(k) == v for k, v in selector.items()):
            out.append(str(name))
    return sorted(out)


def evidence_of(node: Mapping[str, Any]) -> str:
    """Other tools' word on a node (their taints, its abnormal conditions), kept as evidence."""
    parts = [
        f"taint {t.get('key')}={t.get('value', '')}:{t.get('effect')}"
        for t in (node.get("spec") or {}).get("taints") or []
        if t.get("key") != QUARANTINE_TAINT
    ]
    for cond in (node.get("status") or {}).get("conditions") or []:
        healthy = "True" if cond.get("type") == "Ready" else "False"
        if cond.get("status") not in (healthy, None):
            parts.append(f"condition {cond.get('type')}={cond.get('status')}")
    return "; ".join(parts)


def with_quarantine(taints: Sequence[Mapping[str, Any]], reason: str) -> list[dict[str, Any]]:
    """`taints` plus vigil's quarantine taint; every other tool's taint is kept as it is."""
    kept = [dict(t) for t in taints if t.get("key") != QUARANTINE_TAINT]
    return [*kept, {"key": QUARANTINE_TAINT, "value": reason, "effect": "NoSchedule"}]


def quarantined(node: Mapping[str, Any]) -> bool:
    return any(
        t.get("key") == QUARANTINE_TAINT for t in (node.get("spec") or {}).get("taints") or []
    )


@dataclass(frozen=True, kw_only=True)
class BreakerLimits:
    """At most `max_nodes` and at most `max_fraction` of the cluster's nodes quarantined by vigil
    within `window_s`; past that the controller stops quarantining and reports."""

    # Two nodes an hour: one bad node is common, three at once is more likely vigil being wrong
    # (a bad driver roll-out, a network partition) than three broken machines.
    max_nodes: int = 2
    max_fraction: float = 0.1
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_nodes < 0:
            raise ValueError("max_nodes must be >= 0")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError("max_fraction must be within [0, 1]")
        if self.window_s <= 0 or not math.isfinite(self.window_s):
            raise ValueError("window_s must be a finite number > 0")


def breaker_refusal(
    recent_s: Sequence[float], *, now_s: float, total_nodes: int, limits: BreakerLimits
) -> str:
    """Why one more quarantine is refused ("" = allowed). `recent_s`: when each node vigil
    quarantines now was quarantined (from the nodes' own annotations, so every controller and
    every restart of one sees the same count)."""
    within = [t for t in recent_s if now_s - t < limits.window_s]
    after = len(within) + 1
    if after > limits.max_nodes:
        return (
            f"circuit breaker open: {len(within)} node(s) quarantined in the last "
            f"{limits.window_s:.0f} s (limit {limits.max_nodes})"
        )
    # The fraction never refuses the first node: in a small cluster any one node is a big share.
    if total_nodes and after > 1 and after / total_nodes > limits.max_fraction:
        return (
            f"circuit breaker open: quarantining {after} of {total_nodes} nodes exceeds "
            f"{limits.max_fraction:.0%} in {limits.window_s:.0f} s"
        )
    return ""


def parse_generation_map(text: str) -> dict[int, int]:
    """The `ATTEMPT_GENERATION` annotation: "attempt:generation,..."."""
    out: dict[int, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        attempt, _, generation = part.partition(":")
        out[int(attempt)] = int(generation)
    return out


def format_generation_map(mapping: Mapping[int, int]) -> str:
    return ",".join(f"{a}:{g}" for a, g in sorted(mapping.items()))


def trainjob_patch(bad_nodes: list[str]) -> dict[str, Any]:
    """vigil's entry in a TrainJob's manager-keyed `runtimePatches`: keep every pod off the
    quarantined nodes (required node affinity NotIn)."""
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "NotIn",
                                "values": bad_nodes,
                            }
                        ]
                    }
                ]
            }
        }
    }
    return {
        "manager": RUNTIME_PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {"spec": {"podTemplateOverrides": [{"affinity": affinity}]}}
        },
    }


def diag_job(name: str, ns: str, node: str, image: str, command: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"app.kubernetes.io/name": "vigil-diag"},
        },
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": {"job-name": name}},
                "spec": {
                    "nodeName": node,
                    "restartPolicy": "Never",
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "diag", "image": image, "command": command}],
                },
            },
        },
    }


def diag_results(text: str) -> Iterator[DiagResult]:
    for line in text.splitlines():
        if not line.strip().startswith("{"):
            continue
        try:
            record = codec.decode_json(line.encode())
        except Exception:  # a log line that is not a record
            continue
        if isinstance(record, DiagResult):
            yield record


def micro_time(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def parse_time(value: Any) -> float:
    if not value:
        return 0.0
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    text = str(value).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(text).timestamp()
