"""Shrinking a JobSet by a node when no spare is free, the pure part: may it, and to what.

What the APIs allow (checked against the JobSet and Kubeflow Trainer v2 sources): a JobSet's
`replicatedJobs` are immutable except, while it is suspended, the pod template's labels,
annotations, nodeSelector, tolerations and schedulingGates; with JobSet's `ElasticJobSet`
feature gate an Indexed Job's `parallelism` and `completions` (kept equal) may change on a
JobSet that has not finished, but never `replicas`. A TrainJob's `spec.trainer` (numNodes
included) is immutable. So vigil resizes only a JobSet whose workers are ONE Indexed Job
(`replicas: 1`, `parallelism == completions` == the pod count), and only when the job declares
an elastic node range whose minimum allows one node fewer: the annotation `vigil.dev/nnodes:
"MIN:MAX"` on the JobSet, else torchrun's own `--nnodes MIN:MAX` (its `PET_NNODES` environment
variable or the container's command and arguments). The nodes come off the quarantined node by
the quarantine itself (its NoSchedule taint and cordon), which every recreated pod respects.

Plain dicts in, plain values out; no API calls, no `kubernetes` import.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vigil.recovery import k8s_plan

# "MIN:MAX" nodes the job may run on (torchrun's --nnodes), declared on the JobSet.
NNODES_ANNOTATION = "vigil.dev/nnodes"
# Where a resize in progress is journaled on the job: "<attempt>:<from pods>:<to pods>".
RESIZE_ANNOTATION = "vigil.dev/resize"
_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class ResizePlan:
    """Shrink replicated Job `replicated_job` (index `index` in spec.replicatedJobs) from
    `from_pods` pods to `to_pods`, within the elastic range `min_nodes`..`max_nodes`."""

    replicated_job: str
    index: int
    from_pods: int
    to_pods: int
    min_nodes: int
    max_nodes: int


def parse_range(text: str) -> tuple[int, int] | None:
    """ "MIN:MAX" as two ints (None: not a range, e.g. a fixed "4")."""
    match = _RANGE.match(text)
    if not match:
        return None
    low, high = int(match.group(1)), int(match.group(2))
    return (low, high) if 1 <= low <= high else None


def elastic_range(jobset: Mapping[str, Any]) -> tuple[int, int] | None:
    """The node range the job declares (see the module docstring), else None."""
    declared = k8s_plan.annotations_of(jobset).get(NNODES_ANNOTATION)
    if declared is not None:
        return parse_range(declared)
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        pod = (((rj.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
        for container in (pod or {}).get("containers") or []:
            found = _container_range(container)
            if found is not None:
                return found
    return None


def _container_range(container: Mapping[str, Any]) -> tuple[int, int] | None:
    for env in container.get("env") or []:
        if env.get("name") == "PET_NNODES" and isinstance(env.get("value"), str):
            return parse_range(env["value"])
    words = [str(w) for w in [*(container.get("command") or []), *(container.get("args") or [])]]
    # A shell line ("sh -c 'torchrun --nnodes=2:4 ...'") is one word: split it too.
    tokens = [t for w in words for t in w.split()]
    for i, token in enumerate(tokens):
        if token.startswith("--nnodes="):
            return parse_range(token.split("=", 1)[1])
        if token == "--nnodes" and i + 1 < len(tokens):
            return parse_range(tokens[i + 1])
    return None


def plan(jobset: Mapping[str, Any], *, pods: int, drop: int = 1) -> ResizePlan | str:
    """How to run the JobSet on `drop` node(s) fewer than its `pods`, or why it cannot be."""
    declared = elastic_range(jobset)
    if declared is None:
        return (
            "it declares no elastic node range (annotation vigil.dev/nnodes: MIN:MAX, or "
            "torchrun --nnodes MIN:MAX / PET_NNODES in its pod template)"
        )
    low, high = declared
    if pods - drop < low:
        return f"its elastic range {low}:{high} does not allow {pods - drop} node(s)"
    replicated = (jobset.get("spec") or {}).get("replicatedJobs") or []
    if len(replicated) != 1:
        return f"it has {len(replicated)} replicated Jobs; vigil resizes a JobSet of one"
    rj = replicated[0]
    job = (rj.get("template") or {}).get("spec") or {}
    size = job.get("parallelism")
    if (
        int(rj.get("replicas") or 1) != 1
        or job.get("completionMode") != "Indexed"
        or not isinstance(size, int)
        or job.get("completions") != size
        or size != pods
    ):
        return (
            "its workers are not one Indexed Job with replicas 1 and parallelism = completions "
            f"= {pods} (JobSet may change a Job's parallelism and completions, never replicas)"
        )
    return ResizePlan(
        replicated_job=str(rj.get("name")),
        index=0,
        from_pods=pods,
        to_pods=pods - drop,
        min_nodes=low,
        max_nodes=high,
    )


def policy_floor(jobset: Mapping[str, Any], *, pods: int) -> int:
    """The smallest size (pods) the policy may plan a resize down to: the job's elastic minimum,
    and never more than one pod fewer, so that a relocation with no spare is planned as a
    resize. The executor then shrinks the JobSet where `plan` allows, and otherwise keeps the
    job where it runs (quarantined node and all): a restart in place could not place the pod of
    a quarantined node, and would only repeat."""
    declared = elastic_range(jobset)
    low = declared[0] if declared is not None else pods - 1
    return max(1, min(low, pods - 1))


def resized_jobs(jobset: Mapping[str, Any], resize: ResizePlan) -> list[dict[str, Any]]:
    """`spec.replicatedJobs` with the plan's Job at its new size (a merge patch replaces a list
    whole, so the patch carries every replicated Job as it is, but this one's two counts)."""
    jobs: Sequence[Mapping[str, Any]] = (jobset.get("spec") or {}).get("replicatedJobs") or []
    out = [copy.deepcopy(dict(rj)) for rj in jobs]
    spec = out[resize.index]["template"]["spec"]
    spec["parallelism"] = spec["completions"] = resize.to_pods
    return out


def format_record(attempt: int, resize: ResizePlan) -> str:
    return f"{attempt}:{resize.from_pods}:{resize.to_pods}"


def parse_record(text: str) -> tuple[int, int, int] | None:
    """(attempt, from pods, to pods) of the `RESIZE_ANNOTATION` record, None if absent."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        return None
    attempt, old, new = (int(p) for p in parts)
    return attempt, old, new
