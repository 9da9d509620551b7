"""Kubernetes executor: the controller's `Executor` for a JobSet (or a TrainJob's JobSet).

The one module of vigil that imports the official `kubernetes` client (import-linter). It maps the
job to its JobSet and each rank to a pod and its node from the JobSet's labels (`k8s_plan`), and
carries out the controller's steps with the API alone:

- restart: the Eviction API on one pod of the running generation. With the preconditions
  `k8s_plan.precondition_problems` checks (podFailurePolicy FailJob on DisruptionTarget with
  backoffLimit 0; a failurePolicy rule PodFailurePolicy -> RestartJobSetAndIgnoreMaxRestarts),
  that fails the pod's Job and the JobSet recreates every Job as generation g+1 without spending
  maxRestarts. A JobSet lacking them is reported (`problems`) and never touched.
- quarantine (`cordon`): taint `vigil.dev/quarantine=<reason>:NoSchedule` plus cordon, the other
  tools' taints and the node's abnormal conditions kept as evidence in annotations, under a
  circuit breaker counted from the nodes themselves; other tools' taints are never removed.
- a TrainJob (Kubeflow Trainer v2): suspend -> patch `runtimePatches` (manager vigil.dev/recovery:
  node affinity away from quarantined nodes) -> resume; never on a Kueue-managed job.
- attempts: attempt n of the controller runs as the JobSet's restart generation recorded in the
  annotation `vigil.dev/attempt-generation`, so a restarted controller knows which generation
  its attempt is, and `kill_attempt` evicts only while that generation is still healthy (every
  step is idempotent: a second controller, or the same one restarted, never restarts twice).
- checkpoint now and dump stacks: the controller cannot reach a pod's shared memory, so they go
  through the collector to the node agent on the rank's node and its progress page
  (`collector_link.CollectorControl`, the `control` channel here; the controller's checkpointer
  in `k8s_cli`); a rank that does not answer a stack dump gets `py-spy` through the pod's exec.
- modes: `observe` (default; records what it would do, changes nothing: every write raises
  `NotActingError` before any request), `advise` (each write is first posted to the collector as
  a `proposed` action, `approvals`, and made only once a person approved it there; unapproved
  within `approval_timeout_s` it raises `NotActingError`) and `act`; the latter two only in
  allowed namespaces.

409 and 429 answers are retried through the one backoff schedule (`vigil.delivery`). The JobSet
controller, not vigil, creates and deletes pods: `stop` and `forget_node` change nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from vigil.delivery import backoff_delays
from vigil.recovery import k8s_plan
from vigil.recovery.executor import RankExit
from vigil.recovery.k8s_journal import AnnotationStore
from vigil.recovery.placement import Placement
from vigil.schema import Action, ActionKind, ActionState, DiagResult

log = logging.getLogger(__name__)
T = TypeVar("T")

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
TRAINJOB = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
MODES = ("observe", "advise", "act")
# 0.05 s doubling to 2 s over 8 tries: a conflict clears within ms, a throttled API within s.
RETRY_INITIAL_S = 0.05
RETRY_MAX_S = 2.0
RETRY_ATTEMPTS = 8


class NotActingError(RuntimeError):
    """The executor may not change the cluster for this job (mode, namespace, preconditions)."""


class BreakerOpenError(RuntimeError):
    """The quarantine circuit breaker refused one more node: stop and report."""


class LeaseLostError(RuntimeError):
    """Another controller holds the Lease: this one must stop acting."""


def connect(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """An API client from the pod's service account (in a cluster) or a kubeconfig file."""
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
            return k8s.ApiClient()
        except k8s_config.ConfigException:
            pass
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig, context=context, client_configuration=configuration
    )
    return k8s.ApiClient(configuration)


@dataclass
class Api:
    """The API calls vigil makes, each retried on 409/429; counts them (for the bench)."""

    api_client: k8s.ApiClient
    sleep: Callable[[float], None] = time.sleep
    calls: int = 0

    def __post_init__(self) -> None:
        self.core = k8s.CoreV1Api(self.api_client)
        self.batch = k8s.BatchV1Api(self.api_client)
        self.custom = k8s.CustomObjectsApi(self.api_client)
        self.coordination = k8s.CoordinationV1Api(self.api_client)

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` (one API call, re-reading whatever it writes from), retried on 409 Conflict and
        429 Too Many Requests (an eviction a PodDisruptionBudget blocks answers 429 too)."""
        last: ApiException | None = None
        for delay in backoff_delays(RETRY_INITIAL_S, RETRY_MAX_S, RETRY_ATTEMPTS):
            if delay:
                self.sleep(delay)
            self.calls += 1
            try:
                return fn()
            except ApiException as exc:
                if exc.status not in (409, 429):
                    raise
                last = exc
                log.info("API answered %s (%s); retrying", exc.status, exc.reason)
        assert last is not None
        raise last

    def plain(self, obj: Any) -> dict[str, Any]:
        plain = self.api_client.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return cast(dict[str, Any], plain)

    def get_custom(self, kind: tuple[str, str, str], ns: str, name: str) -> dict[str, Any]:
        group, version, plural = kind
        obj = self.call(
            lambda: self.custom.get_namespaced_custom_object(group, version, ns, plural, name)
        )
        return cast(dict[str, Any], obj)

    def patch_custom(
        self, kind: tuple[str, str, str], ns: str, name: str, body: dict[str, Any]
    ) -> None:
        group, version, plural = kind
        self.call(
            lambda: self.custom.patch_namespaced_custom_object(
                group, version, ns, plural, name, body
            )
        )

    def pods(self, ns: str, jobset: str) -> list[dict[str, Any]]:
        selector = f"{k8s_plan.JOBSET_NAME}={jobset}"
        return self._items(
            lambda: self.core.list_namespaced_pod(
                ns, label_selector=selector, _preload_content=False
            )
        )

    def nodes(self) -> list[dict[str, Any]]:
        return self._items(lambda: self.core.list_node(_preload_content=False))

    def read_node(self, name: str) -> dict[str, Any]:
        raw: Any = self.call(lambda: self.core.read_node(name, _preload_content=False))
        return cast(dict[str, Any], json.loads(raw.data))

    def _items(self, fn: Callable[[], Any]) -> list[dict[str, Any]]:
        """A list call's items as plain JSON: the client's model classes cost ~1 ms a pod to build
        and convert back, which a 1,000-pod job pays on every poll."""
        raw = self.call(fn)
        return list(json.loads(raw.data).get("items") or [])


@dataclass
class JobSetAnnotations:
    """`AnnotationStore` on a JobSet (or TrainJob): a merge patch of the given keys alone."""

    api: Api
    namespace: str
    name: str
    kind: tuple[str, str, str] = JOBSET

    def read(self) -> dict[str, str]:
        return k8s_plan.annotations_of(self.api.get_custom(self.kind, self.namespace, self.name))

    def write(self, changes: dict[str, str]) -> None:
        self.api.patch_custom(
            self.kind, self.namespace, self.name, {"metadata": {"annotations": changes}}
        )


class Approver(Protocol):
    def approved(self, proposal: Action, *, timeout_s: float) -> bool:
        """Post `proposal` (once) and wait for a person's approval; True once approved."""


class StackChannel(Protocol):
    def stacks(self, ranks: Sequence[int], *, timeout_s: float) -> dict[int, str]:
        """Each answering rank's own stack dump (`collector_link.CollectorControl`)."""


@dataclass(kw_only=True)
class KubernetesExecutor:
    api: Api
    namespace: str
    # The JobSet's name (a TrainJob's JobSet has the TrainJob's name).
    jobset: str
    # Set for a TrainJob: restarts suspend, patch and resume it instead of evicting a pod.
    trainjob: str = ""
    mode: str = "observe"
    # Namespaces `act` may change; empty: none (every job is observed).
    allowed_namespaces: frozenset[str] = frozenset()
    breaker: k8s_plan.BreakerLimits = field(default_factory=k8s_plan.BreakerLimits)
    # Where the attempt -> generation map lives (the journal's store: annotations, or memory).
    store: AnnotationStore
    ranks_per_pod: int = 1
    # How long a restart may take the JobSet controller to recreate the pods.
    restart_timeout_s: float = 300.0
    # The node diagnostics' image (default: the job's first container image) and command.
    diag_image: str = ""
    diag_command: tuple[str, ...] = ("vigil", "diag", "--quick", "--json")
    # Runs a command in a pod's first container and returns its output (stack dumps); None: the
    # client's exec stream.
    pod_exec: Callable[[str, list[str]], str] | None = None
    # The control path across nodes (`collector_link.CollectorControl`): stack dumps come from
    # the ranks' own SDK through their node agents; ranks that do not answer get the pod exec.
    control: StackChannel | None = None
    stacks_timeout_s: float = 30.0
    # `advise` mode: where changes are proposed and approved (`collector_link.CollectorApprovals`),
    # how long one waits for a person, and the job id the proposals are filed under.
    approvals: Approver | None = None
    approval_timeout_s: float = 600.0
    job_id: str = ""
    # The one-active-controller Lease, renewed on every poll (None: not held, e.g. observe).
    lease: Lease | None = None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    # How often a wait (a restart, pods scheduled, a diagnostics Job) reads the job again.
    poll_s: float = 0.5
    _seen_exits: set[tuple[str, int]] = field(default_factory=set, init=False)
    _problems: list[k8s_plan.Gap] = field(default_factory=list, init=False)
    _suspended_pods: set[str] = field(default_factory=set, init=False)
    # Nodes this executor saw quarantined (by itself or a predecessor): saves a node listing.
    _fenced: set[str] = field(default_factory=set, init=False)
    # The JobSet generation the controller's current attempt runs as (None: not known yet), and
    # the newest generation poll() reported the JobSet restarting to by itself.
    _generation: int | None = field(default=None, init=False)
    _reported_generation: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.ranks_per_pod < 1:
            raise ValueError("ranks_per_pod must be >= 1")
        self._problems = self._check()

    # -- what vigil may do --------------------------------------------------------------------

    def _check(self) -> list[k8s_plan.Gap]:
        gaps = k8s_plan.precondition_gaps(self.read_jobset()) if not self.trainjob else []
        if self.trainjob and k8s_plan.kueue_managed(self.read_trainjob()):
            gaps.append(k8s_plan.kueue_gap(self.trainjob))
        for gap in gaps:
            log.error(
                "%s/%s cannot be recovered safely: %s", self.namespace, self.jobset, gap.message
            )
        return gaps

    @property
    def gaps(self) -> list[k8s_plan.Gap]:
        """The preconditions this job lacks ([] = vigil may restart it)."""
        return list(self._problems)

    @property
    def problems(self) -> list[str]:
        """Why this job may not be restarted by vigil, in words ([] = it may)."""
        return [g.message for g in self._problems]

    @property
    def acting(self) -> bool:
        """Changes may be made: `act` (or `advise`, once approved) in an allowed namespace."""
        return (
            self.mode in ("act", "advise")
            and self.namespace in self.allowed_namespaces
            and not self._problems
        )

    def _guard(self, what: str, kind: ActionKind, target: str) -> None:
        if self.acting and self.mode == "act":
            return
        if self.acting:  # advise: a person approves each change through the collector
            self._await_approval(what, kind, target)
            return
        why = (
            "; ".join(self.problems)
            if self._problems
            else f"namespace {self.namespace} is not allowed to act"
            if self.mode != "observe"
            else "observe mode"
        )
        raise NotActingError(f"would {what} ({why}): nothing changed")

    def _await_approval(self, what: str, kind: ActionKind, target: str) -> None:
        if self.approvals is None:
            raise NotActingError(f"would {what} (advise mode needs a collector): nothing changed")
        # Stable across controller restarts: the same change of the same generation is proposed
        # once, and an approval given to a predecessor holds.
        generation = self._generation if self._generation is not None else -1
        digest = hashlib.sha1(what.encode(), usedforsecurity=False).hexdigest()[:10]
        proposal = Action(
            action_id=f"{self.job_id or self.jobset}-proposal-{kind.value}-g{generation}-{digest}",
            kind=kind,
            job_id=self.job_id or self.jobset,
            target=target,
            state=ActionState.PROPOSED,
            start_s=self.clock(),
            result=f"vigil proposes to {what}; approve: POST /api/v1/actions/<id>/approve",
        )
        log.warning("advise mode: proposed %s (%s); waiting for approval", proposal.action_id, what)
        if not self.approvals.approved(proposal, timeout_s=self.approval_timeout_s):
            raise NotActingError(
                f"would {what} (advise mode: not approved within "
                f"{self.approval_timeout_s:.0f} s as {proposal.action_id}): nothing changed"
            )
        log.warning("advise mode: %s approved; carrying it out", proposal.action_id)

    # -- reading the job ----------------------------------------------------------------------

    def read_jobset(self) -> dict[str, Any]:
        return self.api.get_custom(JOBSET, self.namespace, self.jobset)

    def read_trainjob(self) -> dict[str, Any]:
        return self.api.get_custom(TRAINJOB, self.namespace, self.trainjob)

    def slots(self, jobset: dict[str, Any] | None = None) -> list[k8s_plan.PodSlot]:
        js = jobset or self.read_jobset()
        return k8s_plan.pod_slots(js, self.api.pods(self.namespace, self.jobset))

    def _current(self) -> tuple[int, list[k8s_plan.PodSlot]]:
        js = self.read_jobset()
        generation = k8s_plan.generation_of(js)
        return generation, [s for s in self.slots(js) if s.generation == generation]

    def placement(self, *, timeout_s: float | None = None) -> Placement:
        """The job as it runs now: one active node per pod in rank order, and the spare nodes a
        recreated pod could be scheduled on. Waits for every pod to be scheduled."""
        deadline = self.clock() + (self.restart_timeout_s if timeout_s is None else timeout_s)
        while True:
            js = self.read_jobset()
            generation = k8s_plan.generation_of(js)
            slots = [s for s in self.slots(js) if s.generation == generation and not s.deleting]
            want = k8s_plan.total_pods(js)
            if len(slots) >= want and all(s.node for s in slots):
                break
            if self.clock() > deadline:
                raise RuntimeError(
                    f"{self.namespace}/{self.jobset}: {len(slots)} of {want} pods scheduled"
                )
            self.sleep(self.poll_s)
        nodes = [s.node for s in slots]
        if len(set(nodes)) != len(nodes):
            raise ValueError(
                f"{self.jobset}: pods share nodes ({nodes}); vigil recovers one pod per node "
                "(torchrun --nnodes), set ranks_per_pod to the ranks each pod runs"
            )
        template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        spares = k8s_plan.spare_nodes(self.api.nodes(), nodes, template.get("nodeSelector") or {})
        return Placement(
            active=tuple(nodes), spares=tuple(spares), ranks_per_node=self.ranks_per_pod
        )

    def _generations(self) -> dict[int, int]:
        return k8s_plan.parse_generation_map(self.store.read().get(k8s_plan.ATTEMPT_GENERATION, ""))

    def _ranks(self, slot: k8s_plan.PodSlot) -> range:
        return range(slot.ordinal * self.ranks_per_pod, (slot.ordinal + 1) * self.ranks_per_pod)

    # -- the Executor protocol ----------------------------------------------------------------

    def launch(self, placement: Placement, attempt: int) -> None:
        """Attempt 0 is the JobSet as found; attempt n waits for the restart `kill_attempt`
        triggered (the JobSet controller recreates the pods) and records its generation."""
        generations = self._generations()
        if attempt in generations:
            self._generation = generations[attempt]
            return  # recorded by this controller or its predecessor: already running
        generation = k8s_plan.generation_of(self.read_jobset())
        if attempt > 0:
            before = generations.get(attempt - 1, generation - 1 if generations else 0)
            generation = self._await_generation(before + 1)
        generations[attempt] = generation
        self._generation = generation
        self.store.write({k8s_plan.ATTEMPT_GENERATION: k8s_plan.format_generation_map(generations)})
        if attempt > 0:
            self.placement()  # returns once every pod of the new generation is scheduled

    def _await_generation(self, target: int) -> int:
        deadline = self.clock() + self.restart_timeout_s
        while True:
            generation = k8s_plan.generation_of(self.read_jobset())
            if generation >= target:
                return generation
            # A TrainJob's resume bumps no generation: new pods are the sign.
            if self.trainjob and self._suspended_pods and self._recreated():
                return generation
            if self.clock() > deadline:
                raise RuntimeError(
                    f"{self.jobset} did not restart within {self.restart_timeout_s:.0f} s "
                    f"(generation {generation}, waiting for {target})"
                )
            self.sleep(self.poll_s)

    def _recreated(self) -> bool:
        slots = self.slots()
        return bool(slots) and not {s.name for s in slots} & self._suspended_pods

    def adopt(self, placement: Placement, attempt: int) -> int:
        """The JobSet controller, not vigil, starts pods, so an attempt is never half-launched by
        vigil: a JobSet that is there and not finished runs the whole attempt."""
        js = self.read_jobset()
        self._generation = self._generations().get(attempt)
        terminal = (js.get("status") or {}).get("terminalState")
        return 0 if terminal else placement.world_size

    def kill_attempt(self, attempt: int) -> None:
        """Restart the job out of `attempt`: evict one pod of its generation (a TrainJob:
        suspend, patch, resume). Nothing when that generation is already failing or gone."""
        generation, slots = self._current()
        wanted = self._generations().get(attempt, generation)
        if generation > wanted:
            return  # restarted already (by a predecessor, or by the JobSet after a crash)
        if any(s.disrupted or s.phase == "Failed" for s in slots):
            return  # a pod of this generation failed: its Job fails and the JobSet restarts
        if self.trainjob:
            self._restart_trainjob(slots)
            return
        live = [s for s in slots if s.phase in ("Running", "Pending") and not s.deleting]
        if not live:
            return
        # The pod on a quarantined node if there is one: it is the culprit's.
        quarantined = self._fenced or {
            n["metadata"]["name"] for n in self.api.nodes() if k8s_plan.quarantined(n)
        }
        victim = next((s for s in live if s.node in quarantined), live[0])
        what = f"evict pod {victim.name} to restart JobSet {self.jobset}"
        self._guard(what, ActionKind.RESTART, victim.name)
        body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=victim.name, namespace=self.namespace))
        try:
            self.api.call(
                lambda: self.api.core.create_namespaced_pod_eviction(
                    victim.name, self.namespace, body
                )
            )
        except ApiException as exc:
            if exc.status != 404:  # gone already: its Job is failing
                raise
        log.info("evicted %s (generation %d) to restart %s", victim.name, generation, self.jobset)

    def _restart_trainjob(self, slots: list[k8s_plan.PodSlot]) -> None:
        tj = self.read_trainjob()
        if k8s_plan.kueue_managed(tj):
            raise NotActingError(f"TrainJob {self.trainjob} is Kueue-managed: not toggling suspend")
        self._guard(
            f"suspend, patch and resume TrainJob {self.trainjob}", ActionKind.RESTART, self.trainjob
        )
        bad = sorted(n["metadata"]["name"] for n in self.api.nodes() if k8s_plan.quarantined(n))
        self._suspended_pods = {s.name for s in slots}
        self.api.patch_custom(TRAINJOB, self.namespace, self.trainjob, {"spec": {"suspend": True}})
        # Patch and resume only once the pods are gone: a resume the Trainer never saw suspended
        # would keep the old pods, placement and all.
        deadline = self.clock() + self.restart_timeout_s
        while self.slots():
            if self.clock() > deadline:
                raise RuntimeError(f"TrainJob {self.trainjob} still has pods after suspend")
            self.sleep(self.poll_s)
        patches = [
            p
            for p in (tj.get("spec") or {}).get("runtimePatches") or []
            if p.get("manager") != k8s_plan.RUNTIME_PATCH_MANAGER
        ]
        patches.append(k8s_plan.trainjob_patch(bad))
        self.api.patch_custom(
            TRAINJOB, self.namespace, self.trainjob, {"spec": {"runtimePatches": patches}}
        )
        self.api.patch_custom(TRAINJOB, self.namespace, self.trainjob, {"spec": {"suspend": False}})

    def poll(self) -> list[RankExit]:
        if self.lease is not None:
            self.lease.renew()  # LeaseLostError ends this controller: another one acts now
        generation, slots = self._current()
        exits: list[RankExit] = []
        now = self.clock()
        if (
            self._generation is not None
            and generation > self._generation
            and generation > self._reported_generation
        ):
            # The JobSet restarted by itself (a pod failed, a node was lost) before a poll saw
            # the failed pod: every rank of the attempt ended; the controller restarts after it.
            self._reported_generation = generation
            pods = k8s_plan.total_pods(self.read_jobset())
            log.warning("%s restarted by itself (generation %d)", self.jobset, generation)
            return [
                RankExit(rank=r, node="", returncode=-9, seen_s=now)
                for r in range(pods * self.ranks_per_pod)
            ]
        for slot in slots:
            if slot.phase not in ("Failed", "Succeeded"):
                continue
            key = (slot.name, slot.generation)
            if key in self._seen_exits:
                continue
            self._seen_exits.add(key)
            code = 0 if slot.phase == "Succeeded" else (slot.exit_code or -9)
            exits.extend(
                RankExit(rank=r, node=slot.node, returncode=code, seen_s=now)
                for r in self._ranks(slot)
            )
        return exits

    def alive(self) -> list[int]:
        _, slots = self._current()
        return [r for s in slots if s.phase in ("Running", "Pending") for r in self._ranks(s)]

    def stop(self, *, timeout_s: float) -> None:
        """Nothing: the JobSet controller owns the pods (vigil never deletes a training job);
        the restart itself is `kill_attempt`."""

    def forget_node(self, node: str, job: str) -> None:
        """Nothing: a node keeps no per-job state vigil placed there."""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        out: dict[int, str] = {}
        if self.control is not None and ranks:
            answered = self.control.stacks(ranks, timeout_s=self.stacks_timeout_s)
            out.update({r: text for r, text in answered.items() if r in ranks and text})
        missing = [r for r in ranks if r not in out]
        if not missing:
            return out
        _, slots = self._current()
        for slot in slots:
            wanted = [r for r in self._ranks(slot) if r in missing]
            if not wanted:
                continue
            try:
                text = self._exec(slot.name, ["py-spy", "dump", "--pid", "1", "--subprocesses"])
            except Exception as exc:  # a stack dump is evidence; the recovery goes on without it
                log.warning("could not dump stacks in pod %s: %s", slot.name, exc)
                text = ""
            out.update(dict.fromkeys(wanted, text))
        return out

    def _exec(self, pod: str, command: list[str]) -> str:
        if self.pod_exec is not None:
            return self.pod_exec(pod, command)
        from kubernetes.stream import stream

        return str(
            stream(
                self.api.core.connect_get_namespaced_pod_exec,
                pod,
                self.namespace,
                command=command,
                stderr=True,
                stdout=True,
                stdin=False,
                tty=False,
            )
        )

    def diagnose(self, node: str, *, timeout_s: float) -> list[DiagResult]:
        """A Job pinned to `node` (nodeName, tolerating every taint) runs the quick suite; its
        pod's log holds one DiagResult JSON line per check."""
        self._guard(f"run the node diagnostics as a Job on {node}", ActionKind.DIAGNOSE, node)
        js = self.read_jobset()
        template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        image = self.diag_image or template["containers"][0]["image"]
        name = f"vigil-diag-{uuid.uuid4().hex[:8]}"
        job = k8s_plan.diag_job(
            name, self.namespace, node, image, [*self.diag_command, "--node", node]
        )
        self.api.call(lambda: self.api.batch.create_namespaced_job(self.namespace, cast(Any, job)))
        deadline = self.clock() + timeout_s
        while True:
            status = (
                self.api.plain(
                    self.api.call(lambda: self.api.batch.read_namespaced_job(name, self.namespace))
                ).get("status")
                or {}
            )
            if status.get("succeeded") or status.get("failed"):
                break
            if self.clock() > deadline:
                raise RuntimeError(f"diagnostics on {node} did not finish within {timeout_s:.0f} s")
            self.sleep(self.poll_s)
        listing = self.api.call(
            lambda: self.api.core.list_namespaced_pod(
                self.namespace, label_selector=f"job-name={name}"
            )
        )
        pods = [
            p["metadata"]["name"]
            for p in map(self.api.plain, listing.items)
            if (p["metadata"].get("labels") or {}).get("job-name") == name
        ]
        if not pods:
            raise RuntimeError(f"diagnostics Job {name} on {node} left no pod")
        # Raw bytes: a log is text whatever content type the server names it with.
        raw: Any = self.api.call(
            lambda: self.api.core.read_namespaced_pod_log(
                pods[0], self.namespace, _preload_content=False
            )
        )
        results = list(k8s_plan.diag_results(bytes(raw.data).decode(errors="replace")))
        if not results:
            raise RuntimeError(f"diagnostics on {node} printed no results")
        return results

    def cordon(self, node: str) -> None:
        """Quarantine `node`: vigil's NoSchedule taint and cordon, evidence in annotations; at
        most as many nodes as the circuit breaker allows."""
        now = self.clock()
        nodes = self.api.nodes()
        current = next((n for n in nodes if n["metadata"]["name"] == node), None)
        if current is None:
            raise RuntimeError(f"node {node} is not in the cluster")
        if k8s_plan.quarantined(current):
            self._fenced.add(node)
            return
        recent = [
            float(k8s_plan.annotations_of(n).get(k8s_plan.QUARANTINED_AT, "0"))
            for n in nodes
            if k8s_plan.quarantined(n)
        ]
        refusal = k8s_plan.breaker_refusal(
            recent, now_s=now, total_nodes=len(nodes), limits=self.breaker
        )
        if refusal:
            log.error("not quarantining %s: %s", node, refusal)
            raise BreakerOpenError(f"{node} not quarantined: {refusal}")
        self._guard(
            f"taint {k8s_plan.QUARANTINE_TAINT}:NoSchedule and cordon node {node}",
            ActionKind.CORDON,
            node,
        )

        def patch() -> Any:
            fresh = self.api.read_node(node)
            body = {
                "metadata": {
                    "resourceVersion": fresh["metadata"].get("resourceVersion"),
                    "annotations": {
                        k8s_plan.QUARANTINED_AT: f"{now:.3f}",
                        k8s_plan.QUARANTINE_JOB: f"{self.namespace}/{self.jobset}",
                        k8s_plan.QUARANTINE_EVIDENCE: k8s_plan.evidence_of(fresh) or "none",
                    },
                },
                "spec": {
                    "unschedulable": True,
                    "taints": k8s_plan.with_quarantine(
                        (fresh.get("spec") or {}).get("taints") or [], "recovery"
                    ),
                },
            }
            return self.api.core.patch_node(node, body)

        self.api.call(patch)
        self._fenced.add(node)
        log.warning("quarantined node %s for %s/%s", node, self.namespace, self.jobset)


@dataclass(kw_only=True)
class Lease:
    """One active controller: a coordination.k8s.io Lease taken, renewed and checked."""

    api: Api
    namespace: str
    name: str = "vigil-controller"
    identity: str = field(default_factory=lambda: f"vigil-{uuid.uuid4().hex[:12]}")
    duration_s: int = 15
    clock: Callable[[], float] = time.time
    _renewed_s: float = field(default=0.0, init=False)

    def _body(self, resource_version: str | None) -> dict[str, Any]:
        now = k8s_plan.micro_time(self.clock())
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version:
            meta["resourceVersion"] = resource_version
        return {
            "metadata": meta,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.duration_s,
                "renewTime": now,
                "acquireTime": now,
            },
        }

    def acquire(self) -> bool:
        """Take the Lease if it is free, expired or ours; False while another controller's."""
        coordination = self.api.coordination
        try:
            lease = self.api.plain(coordination.read_namespaced_lease(self.name, self.namespace))
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                coordination.create_namespaced_lease(self.namespace, cast(Any, self._body(None)))
            except ApiException as exc2:
                if exc2.status == 409:
                    return False  # another controller created it first
                raise
            self._renewed_s = self.clock()
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = k8s_plan.parse_time(spec.get("renewTime"))
        expired = (
            renewed + float(spec.get("leaseDurationSeconds") or self.duration_s) < self.clock()
        )
        if holder not in (None, "", self.identity) and not expired:
            return False
        body = self._body(lease["metadata"].get("resourceVersion"))
        self.api.call(
            lambda: coordination.patch_namespaced_lease(self.name, self.namespace, cast(Any, body))
        )
        self._renewed_s = self.clock()
        return True

    def renew(self) -> None:
        """Renew at a third of the duration; LeaseLostError when another controller holds it."""
        if self.clock() - self._renewed_s < self.duration_s / 3:
            return
        if not self.acquire():
            raise LeaseLostError(
                f"Lease {self.namespace}/{self.name} is held by another controller"
            )
