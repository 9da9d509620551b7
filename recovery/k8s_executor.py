"""Kubernetes executor: the controller's `Executor` for a JobSet (or a TrainJob's JobSet).

It maps the job to its JobSet and each rank to a pod and its node from the JobSet's labels
(`k8s_plan`), and carries out the controller's steps through `kubernetes.Api` (the one module
that imports the client; this one takes the `Api` and never does):

- restart: the Eviction API on one pod of the running generation. With the preconditions
  `k8s_plan.precondition_gaps` checks (podFailurePolicy FailJob on DisruptionTarget with
  backoffLimit 0; a failurePolicy rule PodFailurePolicy -> RestartJobSetAndIgnoreMaxRestarts),
  that fails the pod's Job and the JobSet recreates every Job as generation g+1 without spending
  maxRestarts. A job lacking them is reported (`gaps`, `problems`) and never touched.
- quarantine (`cordon`): taint `vigil.dev/quarantine=<reason>:NoSchedule` plus cordon, the other
  tools' taints and the node's abnormal conditions kept as evidence in annotations, under a
  circuit breaker counted from the nodes themselves; other tools' taints are never removed.
- no spare for the pod of a quarantined node: shrink the JobSet by that node where it allows
  (an elastic node range and a resizable shape, `k8s_resize`; suspend -> patch -> resume,
  `k8s_restart`), else stay (`k8s_guard.StayError`: no restart that could not place its pod).
- a TrainJob (Kubeflow Trainer v2): suspend -> patch `runtimePatches` -> resume
  (`k8s_restart`); never on a Kueue-managed job.
- attempts: attempt n of the controller runs as the JobSet's restart generation recorded in the
  annotation `vigil.dev/attempt-generation`, so a restarted controller knows which generation
  its attempt is, and `kill_attempt` evicts only while that generation is still healthy (every
  step is idempotent: a second controller, or the same one restarted, never restarts twice).
- checkpoint now and dump stacks: through the collector to the node agent on the rank's node
  (`collector_link.CollectorControl`, the `control` channel here; the controller's checkpointer
  in `k8s_cli`); a rank that does not answer a stack dump gets `py-spy` through the pod's exec.
- modes (`k8s_guard`): `observe` (default; every write raises `NotActingError` before any
  request), `advise` (each write first proposed through the collector and made once a person
  approved it) and `act`; the latter two only in allowed namespaces.

The JobSet controller, not vigil, creates and deletes pods: `stop` and `forget_node` change
nothing.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vigil.recovery import k8s_guard, k8s_plan, k8s_resize, k8s_restart
from vigil.recovery import kubernetes as kube
from vigil.recovery.executor import RankExit
from vigil.recovery.k8s_guard import BreakerOpenError, NotActingError, StayError
from vigil.recovery.k8s_journal import AnnotationStore
from vigil.recovery.placement import Placement
from vigil.schema import ActionKind, DiagResult

log = logging.getLogger(__name__)
__all__ = ["BreakerOpenError", "KubernetesExecutor", "NotActingError", "StayError"]


@dataclass(kw_only=True)
class KubernetesExecutor:
    api: kube.Api
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
    control: k8s_guard.StackChannel | None = None
    stacks_timeout_s: float = 30.0
    # `advise` mode: where changes are proposed and approved (`collector_link.CollectorApprovals`),
    # how long one waits for a person, and the job id the proposals are filed under.
    approvals: k8s_guard.Approver | None = None
    approval_timeout_s: float = 600.0
    job_id: str = ""
    # The one-active-controller Lease, renewed on every poll (None: not held, e.g. observe).
    lease: kube.Lease | None = None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    # How often a wait (a restart, pods scheduled, a diagnostics Job) reads the job again.
    poll_s: float = 0.5
    # Polls the API server did not answer in time (each skipped; see `poll`).
    unanswered_polls: int = field(default=0, init=False)
    _seen_exits: set[tuple[str, int]] = field(default_factory=set, init=False)
    _problems: list[k8s_plan.Gap] = field(default_factory=list, init=False)
    # The pods a suspend took away (their replacements are the restart's sign).
    suspended_pods: set[str] = field(default_factory=set, init=False)
    # Nodes this executor saw quarantined (by itself or a predecessor): saves a node listing.
    _fenced: set[str] = field(default_factory=set, init=False)
    # The JobSet generation the controller's current attempt runs as (None: not known yet), and
    # the newest generation poll() reported the JobSet restarting to by itself.
    _generation: int | None = field(default=None, init=False)
    _reported_generation: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        if self.mode not in k8s_guard.MODES:
            raise ValueError(f"mode must be one of {k8s_guard.MODES}, got {self.mode!r}")
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
        return k8s_guard.acting(self)

    @property
    def generation(self) -> int:
        """The JobSet generation the current attempt runs as (-1: not known yet)."""
        return self._generation if self._generation is not None else -1

    def _guard(self, what: str, kind: ActionKind, target: str) -> None:
        k8s_guard.guard(self, what, kind, target)

    # -- reading the job ----------------------------------------------------------------------

    def read_jobset(self) -> dict[str, Any]:
        return self.api.get_custom(kube.JOBSET, self.namespace, self.jobset)

    def read_trainjob(self) -> dict[str, Any]:
        return self.api.get_custom(kube.TRAINJOB, self.namespace, self.trainjob)

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
        triggered (the JobSet controller recreates the pods, or a resize's resume does) and
        records its generation."""
        generations = self._generations()
        if attempt in generations:
            self._generation = generations[attempt]
            return  # recorded by this controller or its predecessor: already running
        generation = k8s_plan.generation_of(self.read_jobset())
        if attempt > 0:
            record = None if self.trainjob else k8s_restart.resize_record(self)
            if record is not None and record[0] == attempt - 1:
                generation = self._await(
                    lambda: k8s_restart.resized(self, record[2]), f"resized to {record[2]} pods"
                )
            else:
                before = generations.get(attempt - 1, generation - 1 if generations else 0)
                generation = self._await(
                    lambda: self._restarted(before + 1), f"generation {before + 1}"
                )
        generations[attempt] = generation
        self._generation = generation
        self.store.write({k8s_plan.ATTEMPT_GENERATION: k8s_plan.format_generation_map(generations)})
        if attempt > 0:
            self.placement()  # returns once every pod of the new generation is scheduled

    def _restarted(self, target: int) -> bool:
        if k8s_plan.generation_of(self.read_jobset()) >= target:
            return True
        # A TrainJob's resume bumps no generation: new pods are the sign.
        return bool(self.trainjob and self.suspended_pods and self._recreated())

    def _await(self, done: Callable[[], bool], what: str) -> int:
        """Poll `done` until true (RuntimeError after `restart_timeout_s`); the generation."""
        deadline = self.clock() + self.restart_timeout_s
        while not done():
            if self.clock() > deadline:
                raise RuntimeError(
                    f"{self.jobset} did not restart within {self.restart_timeout_s:.0f} s "
                    f"(waiting for {what})"
                )
            self.sleep(self.poll_s)
        return k8s_plan.generation_of(self.read_jobset())

    def _recreated(self) -> bool:
        slots = self.slots()
        return bool(slots) and not {s.name for s in slots} & self.suspended_pods

    def adopt(self, placement: Placement, attempt: int) -> int:
        """The JobSet controller, not vigil, starts pods, so an attempt is never half-launched by
        vigil: a JobSet that is there and not finished runs the whole attempt."""
        js = self.read_jobset()
        self._generation = self._generations().get(attempt)
        terminal = (js.get("status") or {}).get("terminalState")
        return 0 if terminal else placement.world_size

    def kill_attempt(self, attempt: int) -> None:
        """Restart the job out of `attempt`: evict one pod of its generation (a TrainJob:
        suspend, patch, resume). With the culprit's node quarantined and no spare free: shrink
        the JobSet by that node where it allows (`k8s_resize`), else stay (`StayError`). Nothing
        when that generation is already failing, gone, or resized."""
        notes = self.store.read()
        record = k8s_resize.parse_record(notes.get(k8s_resize.RESIZE_ANNOTATION, ""))
        if record is not None and record[0] == attempt and not self.trainjob:
            k8s_restart.continue_resize(self, record[2])  # begun by this or a killed controller
            return
        js = self.read_jobset()
        generation = k8s_plan.generation_of(js)
        slots = [s for s in self.slots(js) if s.generation == generation]
        generations = k8s_plan.parse_generation_map(notes.get(k8s_plan.ATTEMPT_GENERATION, ""))
        wanted = generations.get(attempt, generation)
        if generation > wanted:
            return  # restarted already (by a predecessor, or by the JobSet after a crash)
        if any(s.disrupted or s.phase == "Failed" for s in slots):
            return  # a pod of this generation failed: its Job fails and the JobSet restarts
        live = [s for s in slots if s.phase in ("Running", "Pending") and not s.deleting]
        if not live and not self.trainjob:
            return
        nodes = self.api.nodes()
        quarantined = {n["metadata"]["name"] for n in nodes if k8s_plan.quarantined(n)}
        self._fenced |= quarantined
        # The pod on a quarantined node if there is one: it is the culprit's.
        victim = next((s for s in live if s.node in quarantined), live[0] if live else None)
        if victim is not None and victim.node in quarantined and not self._spares(js, nodes, slots):
            self._shrink(attempt, slots, victim)
            return
        if self.trainjob:
            k8s_restart.restart_trainjob(self, slots)
            return
        assert victim is not None
        self._guard(
            f"evict pod {victim.name} to restart JobSet {self.jobset}",
            ActionKind.RESTART,
            victim.name,
        )
        self.api.evict(self.namespace, victim.name)  # False: gone already, its Job is failing
        log.info("evicted %s (generation %d) to restart %s", victim.name, generation, self.jobset)

    def _spares(
        self, js: dict[str, Any], nodes: list[dict[str, Any]], slots: list[k8s_plan.PodSlot]
    ) -> list[str]:
        """Nodes the recreated pod of a quarantined node could be scheduled on."""
        template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        selector = (template.get("spec") or {}).get("nodeSelector") or {}
        return k8s_plan.spare_nodes(nodes, [s.node for s in slots], selector)

    def _shrink(
        self, attempt: int, slots: list[k8s_plan.PodSlot], victim: k8s_plan.PodSlot
    ) -> None:
        """No spare for the quarantined node's pod: one node fewer where the job allows it;
        otherwise the job stays where it runs (a restart could not place that pod)."""
        resize = (
            "it is a TrainJob (spec.trainer.numNodes is immutable)"
            if self.trainjob
            else k8s_resize.plan(self.read_jobset(), pods=len(slots))
        )
        if isinstance(resize, str):
            raise k8s_guard.StayError(
                f"not restarting {self.jobset}: pod {victim.name} is on quarantined node "
                f"{victim.node}, no spare node is free and {resize}; the job stays on its "
                "nodes (a restart could not place that pod)"
            )
        k8s_restart.resize_jobset(self, attempt, resize)

    def poll(self) -> list[RankExit]:
        """The ranks whose pods ended since the last poll. A poll the API server does not answer
        in time sees nothing, and says so: the controller polls again at its next tick, and acts
        on nothing it could not read (an unrenewed Lease is renewed, or found lost, then)."""
        try:
            return self._poll()
        except kube.ApiUnavailableError as exc:
            self.unanswered_polls += 1
            log.warning("%s: poll skipped (%d so far): %s", self.jobset, self.unanswered_polls, exc)
            return []

    def _poll(self) -> list[RankExit]:
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
        return self.api.exec(self.namespace, pod, command)

    def diagnose(self, node: str, *, timeout_s: float) -> list[DiagResult]:
        """A Job pinned to `node` (nodeName, tolerating every taint) runs the quick suite; its
        pod's log holds one DiagResult JSON line per check."""
        self._guard(f"run the node diagnostics as a Job on {node}", ActionKind.DIAGNOSE, node)
        js = self.read_jobset()
        template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        image = self.diag_image or template["containers"][0]["image"]
        name = f"vigil-diag-{uuid.uuid4().hex[:8]}"
        command = [*self.diag_command, "--node", node]
        self.api.create_job(
            self.namespace, k8s_plan.diag_job(name, self.namespace, node, image, command)
        )
        deadline = self.clock() + timeout_s
        while True:
            status = self.api.job_status(self.namespace, name)
            if status.get("succeeded") or status.get("failed"):
                break
            if self.clock() > deadline:
                raise RuntimeError(f"diagnostics on {node} did not finish within {timeout_s:.0f} s")
            self.sleep(self.poll_s)
        pods = [
            p["metadata"]["name"]
            for p in self.api.pods_labelled(self.namespace, f"job-name={name}")
            if (p["metadata"].get("labels") or {}).get("job-name") == name
        ]
        if not pods:
            raise RuntimeError(f"diagnostics Job {name} on {node} left no pod")
        results = list(k8s_plan.diag_results(self.api.pod_log(self.namespace, pods[0])))
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
            raise k8s_guard.BreakerOpenError(f"{node} not quarantined: {refusal}")
        self._guard(
            f"taint {k8s_plan.QUARANTINE_TAINT}:NoSchedule and cordon node {node}",
            ActionKind.CORDON,
            node,
        )

        def body(fresh: dict[str, Any]) -> dict[str, Any]:
            return {
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

        self.api.patch_node(node, body)
        self._fenced.add(node)
        log.warning("quarantined node %s for %s/%s", node, self.namespace, self.jobset)
