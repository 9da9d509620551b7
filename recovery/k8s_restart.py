"""The suspend -> patch -> resume restarts of the Kubernetes executor.

- a TrainJob (Kubeflow Trainer v2): suspend, wait for its pods to go, patch its manager-keyed
  `runtimePatches` (manager `vigil.dev/recovery`: a required node affinity NotIn the quarantined
  nodes), resume; never on a Kueue-managed job (Kueue owns its `suspend`).
- a JobSet shrunk by a node when no spare is free (`k8s_resize.plan`): journal the resize on the
  job (`vigil.dev/resize`), suspend, wait for its pods to go, patch the Job's parallelism and
  completions down, resume. The quarantine (taint + cordon) keeps the recreated pods off the bad
  node. A controller killed anywhere in between finds the record and finishes the same resize
  (never a second one); a resize the API refuses (no `ElasticJobSet` feature gate) resumes the
  JobSet as it was and says so.

Each step is idempotent. Works through the executor's `Api` (no `kubernetes` import here).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vigil.recovery import k8s_guard, k8s_plan, k8s_resize
from vigil.recovery import kubernetes as kube
from vigil.schema import ActionKind

if TYPE_CHECKING:
    from vigil.recovery.k8s_executor import KubernetesExecutor

log = logging.getLogger(__name__)


def restart_trainjob(ex: KubernetesExecutor, slots: list[k8s_plan.PodSlot]) -> None:
    tj = ex.read_trainjob()
    if k8s_plan.kueue_managed(tj):
        raise k8s_guard.NotActingError(
            f"TrainJob {ex.trainjob} is Kueue-managed: not toggling suspend"
        )
    k8s_guard.guard(
        ex, f"suspend, patch and resume TrainJob {ex.trainjob}", ActionKind.RESTART, ex.trainjob
    )
    bad = sorted(n["metadata"]["name"] for n in ex.api.nodes() if k8s_plan.quarantined(n))
    ex.suspended_pods = {s.name for s in slots}
    ex.api.patch_custom(kube.TRAINJOB, ex.namespace, ex.trainjob, {"spec": {"suspend": True}})
    # Patch and resume only once the pods are gone: a resume the Trainer never saw suspended
    # would keep the old pods, placement and all.
    _await_no_pods(ex, f"TrainJob {ex.trainjob}")
    patches = [
        p
        for p in (tj.get("spec") or {}).get("runtimePatches") or []
        if p.get("manager") != k8s_plan.RUNTIME_PATCH_MANAGER
    ]
    patches.append(k8s_plan.trainjob_patch(bad))
    ex.api.patch_custom(
        kube.TRAINJOB, ex.namespace, ex.trainjob, {"spec": {"runtimePatches": patches}}
    )
    ex.api.patch_custom(kube.TRAINJOB, ex.namespace, ex.trainjob, {"spec": {"suspend": False}})


def resize_record(ex: KubernetesExecutor) -> tuple[int, int, int] | None:
    """The resize journaled on the job: (attempt, from pods, to pods), or None."""
    return k8s_resize.parse_record(ex.store.read().get(k8s_resize.RESIZE_ANNOTATION, ""))


def resize_jobset(ex: KubernetesExecutor, attempt: int, resize: k8s_resize.ResizePlan) -> None:
    """Shrink the JobSet out of `attempt` as `resize` says (see the module docstring)."""
    what = (
        f"suspend JobSet {ex.jobset}, set replicatedJob {resize.replicated_job} to "
        f"{resize.to_pods} pods (from {resize.from_pods}; elastic range "
        f"{resize.min_nodes}:{resize.max_nodes}) and resume it"
    )
    k8s_guard.guard(ex, what, ActionKind.RESIZE, ex.jobset)
    ex.store.write({k8s_resize.RESIZE_ANNOTATION: k8s_resize.format_record(attempt, resize)})
    finish_resize(ex, resize.to_pods)


def finish_resize(ex: KubernetesExecutor, to_pods: int) -> None:
    """Suspend (if not yet), wait for the pods to go, set the size, resume: from wherever a
    predecessor stopped (each step is a no-op once done)."""
    js = ex.read_jobset()
    if not (js.get("spec") or {}).get("suspend"):
        ex.suspended_pods = {s.name for s in ex.slots(js)}
        ex.api.patch_custom(kube.JOBSET, ex.namespace, ex.jobset, {"spec": {"suspend": True}})
    _await_no_pods(ex, f"JobSet {ex.jobset}")
    js = ex.read_jobset()
    if k8s_plan.total_pods(js) != to_pods:
        plan = k8s_resize.plan(
            js, pods=k8s_plan.total_pods(js), drop=k8s_plan.total_pods(js) - to_pods
        )
        if isinstance(plan, str):
            _resume(ex)
            raise k8s_guard.StayError(f"not resizing JobSet {ex.jobset}: {plan}; resumed as it was")
        body = {"spec": {"replicatedJobs": k8s_resize.resized_jobs(js, plan)}}
        try:
            ex.api.patch_custom(kube.JOBSET, ex.namespace, ex.jobset, body)
        except kube.RefusedError as exc:
            _resume(ex)
            raise k8s_guard.StayError(
                f"the API server refused to resize JobSet {ex.jobset} ({exc}; JobSet needs its "
                "ElasticJobSet feature gate to change a Job's parallelism); resumed as it was"
            ) from exc
    _resume(ex)
    log.warning("resized JobSet %s/%s to %d pods", ex.namespace, ex.jobset, to_pods)


def continue_resize(ex: KubernetesExecutor, to_pods: int) -> None:
    """A resize journaled for the attempt being restarted: finish it unless it is done (resumed
    at the new size: its pods are being recreated, nothing more to do)."""
    js = ex.read_jobset()
    suspended = bool((js.get("spec") or {}).get("suspend"))
    if not suspended and k8s_plan.total_pods(js) == to_pods:
        return
    finish_resize(ex, to_pods)


def resized(ex: KubernetesExecutor, to_pods: int) -> bool:
    """The JobSet runs again at its new size: resumed, and its pods (all new: the old ones went
    before the resume) exist."""
    js = ex.read_jobset()
    if (js.get("spec") or {}).get("suspend") or k8s_plan.total_pods(js) != to_pods:
        return False
    live = [s for s in ex.slots(js) if not s.deleting]
    return len(live) >= to_pods


def _resume(ex: KubernetesExecutor) -> None:
    ex.api.patch_custom(kube.JOBSET, ex.namespace, ex.jobset, {"spec": {"suspend": False}})


def _await_no_pods(ex: KubernetesExecutor, what: str) -> None:
    deadline = ex.clock() + ex.restart_timeout_s
    while ex.slots():
        if ex.clock() > deadline:
            raise RuntimeError(f"{what} still has pods {ex.restart_timeout_s:.0f} s after suspend")
        ex.sleep(ex.poll_s)
