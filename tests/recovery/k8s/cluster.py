"""A Kubernetes cluster for the executor's tests: kmock's emulator plus a fake JobSet controller.

`Cluster` runs kmock's `KubernetesEmulator` (the bundled resource list loaded) on an event loop of
its own thread and hands out official-client `ApiClient`s to it over HTTP, so vigil's code runs
unchanged. The emulator ignores label selectors, keeps no real resourceVersion and answers 404
for `pods/eviction` until a reaction is declared: `Cluster` declares the eviction (the pod gets
the DisruptionTarget condition and fails, as the API server and kubelet do) and pod logs, and
injects 409/429 answers on request (`fail`), which are recorded and change nothing.

`FakeJobSetController` is NOT the JobSet controller: it is a few lines that behave the way the
JobSet and Job controllers do for what vigil relies on. It creates one pod per (Job index,
completion index) labelled like JobSet's pods (jobset-name, replicatedjob-name, job-index,
restart-attempt, job-completion-index), places each on a node the scheduler would accept (not
cordoned, no untolerated NoSchedule taint, nodeSelector and a TrainJob's NotIn affinity honoured),
and when a pod of the current generation fails (podFailurePolicy FailJob on DisruptionTarget),
fails the Job and restarts the JobSet: status.restarts + 1, every old pod deleted, every pod
recreated. A suspended JobSet (or TrainJob) has no pods; resumed, they are recreated. It also runs
vigil's diagnostics Jobs (completes them; their log is `Cluster.diag_logs[node]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kmock
from kmock._internal import k8s as kmock_k8s
from kubernetes import client

from vigil.recovery import kubernetes as kube

PODS = kmock.resource("", "v1", "pods")
JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
TRAINJOB_API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
FAKE_AGENT = "fake-jobset-controller"
_SUFFIX = itertools.count()


@dataclass(frozen=True)
class Call:
    """One request the emulator served, in arrival order."""

    id: int
    method: str
    path: str
    subresource: str | None
    data: Any
    agent: str

    @property
    def write(self) -> bool:
        return self.method in ("POST", "PATCH", "PUT", "DELETE")


class _Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    faults: dict[tuple[str, str], list[int]]

    async def _handle(self, request: Any) -> Any:
        key = (str(request.method.value).upper(), str(request.url.path))
        for (method, fragment), statuses in self.faults.items():
            if method == key[0] and fragment in key[1] and statuses:
                status = statuses.pop(0)
                raise kmock_k8s.KubernetesError(status=status, reason="Injected", message="test")
        return await super()._handle(request)


class Cluster:
    def __init__(self) -> None:
        self.diag_logs: dict[str, str] = {}
        # When each eviction reached the API server (time.time()).
        self.evicted_s: list[float] = []
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the emulator did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        emulator = _Emulator()
        emulator.faults = {}
        async with emulator as k, kmock.Server(k) as server:
            k.resources.load_bundled()
            k["post", PODS, kmock.subresource("eviction")] << self._evict
            k["get", PODS, kmock.subresource("log")] << self._log
            self.k = k
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def _evict(self, request: Any) -> dict[str, Any]:
        self.evicted_s.append(time.time())
        obj = self.k.objects[PODS, request.namespace, request.name]
        obj.patch(
            {
                "status": {
                    "phase": "Failed",
                    "conditions": [
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "EvictionByEvictionAPI",
                        }
                    ],
                }
            }
        )
        return {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201}

    def _log(self, request: Any) -> bytes:
        node = self.k.objects[PODS, request.namespace, request.name]["spec"]["nodeName"]
        return self.diag_logs.get(node, "").encode()

    def fail(self, method: str, path_fragment: str, *statuses: int) -> None:
        """Answer the next requests of `method` on paths containing `path_fragment` with these
        statuses (409, 429), one each; the request changes nothing."""
        self.k.faults.setdefault((method, path_fragment), []).extend(statuses)

    def client(self, agent: str = "vigil", timeout_s: float | None = None) -> client.ApiClient:
        """An official client of this cluster; `timeout_s`: each request's default timeout."""
        configuration = client.Configuration()
        configuration.host = self.url
        api = client.ApiClient(configuration)
        api.user_agent = agent
        if timeout_s is not None:
            kube.bound_requests(api, timeout_s)
        return api

    def calls(self) -> list[Call]:
        out = []
        for r in list(self.k._requests):
            out.append(
                Call(
                    id=r.id,
                    method=str(r.method.value).upper(),
                    path=str(r.url.path),
                    subresource=r.subresource,
                    data=r.data,
                    agent=str(r.headers.get("User-Agent", "")),
                )
            )
        return out

    def vigil_calls(self) -> list[Call]:
        return [c for c in self.calls() if c.agent != FAKE_AGENT]

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def kubeconfig(self) -> str:
        return (
            "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
            f"clusters:\n- name: kmock\n  cluster:\n    server: {self.url}\n"
            "users:\n- name: kmock\n  user: {}\n"
            "contexts:\n- name: kmock\n  context:\n    cluster: kmock\n    user: kmock\n"
        )


def node(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


def jobset(
    name: str,
    ns: str,
    *,
    replicas: int,
    safe: bool = True,
    parallelism: int = 1,
    args: tuple[str, ...] = (),
    annotations: dict[str, str] | None = None,
    **labels: str,
) -> dict[str, Any]:
    """A JobSet of `replicas` Indexed Jobs of `parallelism` pods each (the trainer container runs
    `args`); `safe`: with the preconditions vigil needs."""
    job_spec: dict[str, Any] = {
        "parallelism": parallelism,
        "completions": parallelism,
        "completionMode": "Indexed",
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {"name": "trainer", "image": "example.com/train:1", "args": list(args)}
                ],
            }
        },
    }
    spec: dict[str, Any] = {
        "replicatedJobs": [
            {"name": "workers", "replicas": replicas, "template": {"spec": job_spec}}
        ]
    }
    if safe:
        job_spec["backoffLimit"] = 0
        job_spec["podFailurePolicy"] = {
            "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}]
        }
        spec["failurePolicy"] = {
            "maxRestarts": 3,
            "rules": [
                {
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }
            ],
        }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": labels,
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"restarts": 0},
    }


class FakeJobSetController:
    """See the module docstring: restarts a JobSet the way the JobSet controller does."""

    def __init__(self, cluster: Cluster, ns: str, *, tick_s: float = 0.05) -> None:
        self.cluster = cluster
        self.ns = ns
        # Bounded: once in a CI run a request of this thread never got its answer, so it
        # never restarted the JobSet and the test timed out; a timed-out tick is retried.
        api = cluster.client(FAKE_AGENT, timeout_s=10.0)
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.tick_s = tick_s
        # (generation, pod ordinal, node) of every pod created, in order.
        self.placed: list[tuple[int, int, str]] = []
        # When each generation's pods all existed (for the bench's time to recover).
        self.recreated_s: dict[int, float] = {}
        self.finish_generation: int | None = None
        # Whether a TrainJob owns the JobSet (its suspend and runtimePatches then apply).
        self.trainjob = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-jobset", daemon=True)

    def start(self) -> FakeJobSetController:
        self.reconcile()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            with contextlib.suppress(Exception):  # a torn read while vigil writes: next tick
                self.reconcile()

    def _pods(self, name: str) -> list[dict[str, Any]]:
        # Plain JSON, not the client's model classes (~1 ms a pod to build and convert back):
        # this runs every tick in the bench's process, beside the controller it times.
        raw = self.core.list_namespaced_pod(self.ns, _preload_content=False)
        pods: list[dict[str, Any]] = json.loads(raw.data).get("items") or []
        return [
            p
            for p in pods
            if p["metadata"].get("labels", {}).get("jobset.sigs.k8s.io/jobset-name") == name
        ]

    def reconcile(self) -> None:
        group, version, plural = JOBSET_API
        for js in self.custom.list_namespaced_custom_object(group, version, self.ns, plural)[
            "items"
        ]:
            self._reconcile(js)
        self._run_diag_jobs()

    def _reconcile(self, js: dict[str, Any]) -> None:
        name = js["metadata"]["name"]
        group, version, plural = JOBSET_API
        generation = int((js.get("status") or {}).get("restarts") or 0)
        suspended, avoid = bool(js["spec"].get("suspend")), set()
        with contextlib.suppress(client.exceptions.ApiException):
            if not self.trainjob:
                raise client.exceptions.ApiException(status=404)
            tj = self.custom.get_namespaced_custom_object(
                *TRAINJOB_API[:2], self.ns, TRAINJOB_API[2], name
            )
            suspended = bool(tj["spec"].get("suspend"))
            for patch in tj["spec"].get("runtimePatches") or []:
                for override in patch["trainingRuntimeSpec"]["template"]["spec"][
                    "podTemplateOverrides"
                ]:
                    terms = override["affinity"]["nodeAffinity"][
                        "requiredDuringSchedulingIgnoredDuringExecution"
                    ]["nodeSelectorTerms"]
                    for term in terms:
                        for expr in term["matchExpressions"]:
                            avoid |= set(expr["values"])
        pods = self._pods(name)
        if suspended:
            for pod in pods:
                self._delete(pod)
            return
        current = [
            p
            for p in pods
            if int(p["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"]) == generation
        ]
        if self.finish_generation is not None and generation >= self.finish_generation and current:
            for pod in current:
                if pod["status"].get("phase") == "Running":
                    self.core.patch_namespaced_pod(
                        pod["metadata"]["name"], self.ns, {"status": {"phase": "Succeeded"}}
                    )
            return
        failed = any(
            p["status"].get("phase") == "Failed"
            or any(c.get("type") == "DisruptionTarget" for c in p["status"].get("conditions") or [])
            for p in current
        )
        if failed:  # the Job fails (FailJob); the JobSet recreates all Jobs as the next generation
            generation += 1
            self.custom.patch_namespaced_custom_object(
                group, version, self.ns, plural, name, {"status": {"restarts": generation}}
            )
            for pod in pods:
                self._delete(pod)
            pods, current = [], []
        job = js["spec"]["replicatedJobs"][0]
        per_job = int(job["template"]["spec"].get("parallelism") or 1)
        want = [(i, c) for i in range(int(job["replicas"])) for c in range(per_job)]
        have = {_slot(p) for p in current}
        # A Job whose parallelism went down deletes its highest-indexed pods.
        for pod in current:
            if _slot(pod) not in want:
                self._delete(pod)
        missing = [k for k in want if k not in have]
        if not missing:
            return
        nodes = json.loads(self.core.list_node(_preload_content=False).data).get("items") or []
        busy = {p["spec"].get("nodeName") for p in current}
        for index, completion in missing:
            target = next(
                (
                    n["metadata"]["name"]
                    for n in nodes
                    if _schedulable(n) and n["metadata"]["name"] not in busy | avoid
                ),
                None,
            )
            if target is None:
                continue  # Pending: no node fits
            busy.add(target)
            self.core.create_namespaced_pod(
                self.ns, _pod(name, self.ns, (index, completion), generation, target)
            )
            self.placed.append((generation, index * per_job + completion, target))
            have.add((index, completion))
        if set(want) <= have:
            self.recreated_s.setdefault(generation, time.time())

    def _delete(self, pod: dict[str, Any]) -> None:
        with contextlib.suppress(client.exceptions.ApiException):
            self.core.delete_namespaced_pod(pod["metadata"]["name"], self.ns)

    def _run_diag_jobs(self) -> None:
        for job in self.batch.list_namespaced_job(self.ns).items:
            if (job.metadata.labels or {}).get("app.kubernetes.io/name") != "vigil-diag":
                continue
            if job.status and job.status.succeeded:
                continue
            name = job.metadata.name
            node_name = job.spec.template.spec.node_name
            with contextlib.suppress(client.exceptions.ApiException):
                self.core.create_namespaced_pod(
                    self.ns,
                    {
                        "metadata": {
                            "name": f"{name}-pod",
                            "namespace": self.ns,
                            "labels": {"job-name": name},
                        },
                        "spec": {
                            "nodeName": node_name,
                            "containers": [{"name": "diag", "image": "x"}],
                        },
                        "status": {"phase": "Succeeded"},
                    },
                )
            self.batch.patch_namespaced_job(name, self.ns, {"status": {"succeeded": 1}})


def _schedulable(n: dict[str, Any]) -> bool:
    spec = n.get("spec") or {}
    return not spec.get("unschedulable") and not any(
        t.get("effect") in ("NoSchedule", "NoExecute") for t in spec.get("taints") or []
    )


def _slot(pod: dict[str, Any]) -> tuple[int, int]:
    labels = pod["metadata"]["labels"]
    return (
        int(labels["jobset.sigs.k8s.io/job-index"]),
        int(labels["batch.kubernetes.io/job-completion-index"]),
    )


def _pod(
    jobset_name: str, ns: str, slot: tuple[int, int], generation: int, node_name: str
) -> dict[str, Any]:
    index, completion = slot
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            # Like the Job controller's random suffix: a recreated pod never reuses a name.
            "name": f"{jobset_name}-workers-{index}-{completion}-g{generation}-{next(_SUFFIX):04d}",
            "namespace": ns,
            "labels": {
                "jobset.sigs.k8s.io/jobset-name": jobset_name,
                "jobset.sigs.k8s.io/replicatedjob-name": "workers",
                "jobset.sigs.k8s.io/job-index": str(index),
                "jobset.sigs.k8s.io/restart-attempt": str(generation),
                "batch.kubernetes.io/job-completion-index": str(completion),
            },
        },
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "trainer", "image": "example.com/train:1"}],
        },
        "status": {"phase": "Running"},
    }


@contextlib.contextmanager
def running(
    ns: str, *, nodes: int, replicas: int, safe: bool = True, **options: Any
) -> Iterator[tuple[Cluster, FakeJobSetController]]:
    """A cluster of `nodes` nodes running JobSet "train" of `replicas` Jobs in `ns` (`options`:
    `jobset`'s parallelism, args, annotations and labels)."""
    cluster = Cluster()
    core = client.CoreV1Api(cluster.client(FAKE_AGENT))
    custom = client.CustomObjectsApi(cluster.client(FAKE_AGENT))
    for i in range(nodes):
        core.create_node(node(f"node-{i}"))
    group, version, plural = JOBSET_API
    custom.create_namespaced_custom_object(
        group, version, ns, plural, jobset("train", ns, replicas=replicas, safe=safe, **options)
    )
    fake = FakeJobSetController(cluster, ns).start()
    try:
        yield cluster, fake
    finally:
        fake.stop()
        cluster.close()
