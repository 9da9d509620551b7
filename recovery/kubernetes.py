"""The Kubernetes API as vigil uses it: the one module of vigil that imports the official
`kubernetes` client (import-linter), and nothing but the calls.

`Api` makes every request the recovery controller needs (read a JobSet or TrainJob, merge-patch
it, list pods and nodes, patch a node from its fresh state, evict a pod, create and read a
diagnostics Job and its pod's log, exec in a pod, the Lease) and retries 409 Conflict and 429
Too Many Requests through the one backoff schedule (`vigil.delivery`); it counts its calls (the
bench reports them). Every request has a deadline (`request_timeout_s`, below the Lease's
duration): an API server that accepts a connection and never answers would otherwise hold the
controller, and the Lease it must renew, forever; past it a call raises `ApiUnavailableError`.
Lists come back as plain JSON (the client's model classes cost ~1 ms a pod).
`JobSetAnnotations` is the journal's `AnnotationStore` on the job; `Lease` keeps one controller
active. What to do with these calls is `k8s_executor.KubernetesExecutor` (and the
modules it uses: `k8s_guard`, `k8s_restart`, `k8s_plan`), which take an `Api` and never
import the client.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as TransportError

from vigil.delivery import backoff_delays
from vigil.recovery import k8s_plan

log = logging.getLogger(__name__)
T = TypeVar("T")

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
TRAINJOB = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
# 0.05 s doubling to 2 s over 8 tries: a conflict clears within ms, a throttled API within s.
RETRY_INITIAL_S = 0.05
RETRY_MAX_S = 2.0
RETRY_ATTEMPTS = 8
# A request's deadline, connect and read each: a third less than the Lease's default 15 s, so a
# hung call ends (and the poll that made it is skipped) before another controller may take over.
REQUEST_TIMEOUT_S = 10.0


class LeaseLostError(RuntimeError):
    """Another controller holds the Lease: this one must stop acting."""


class ApiUnavailableError(RuntimeError):
    """The API server did not answer within the request's deadline, or the connection failed."""


class RefusedError(RuntimeError):
    """The API server refused a write as invalid (422) or forbidden (403): the message says why."""


def connect(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """An API client from the pod's service account (in a cluster) or a kubeconfig file. Its
    transport does not retry by itself (urllib3 would repeat a read that timed out three times,
    stretching `Api.request_timeout_s` fourfold): `Api.call` decides what is retried."""
    configuration = k8s.Configuration()
    configuration.retries = False
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
            return k8s.ApiClient(configuration)
        except k8s_config.ConfigException:
            pass
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
    request_timeout_s: float = REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        bound_requests(self.api_client, self.request_timeout_s)
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
                return self.answered(fn)
            except ApiException as exc:
                if exc.status in (403, 422):
                    raise RefusedError(f"{exc.status} {exc.reason}: {_message(exc)}") from exc
                if exc.status not in (409, 429):
                    raise
                last = exc
                log.info("API answered %s (%s); retrying", exc.status, exc.reason)
        assert last is not None
        raise last

    def answered(self, fn: Callable[[], T]) -> T:
        """`fn()`, its transport failures (no answer within the deadline, a refused or reset
        connection) raised as `ApiUnavailableError`."""
        try:
            return fn()
        except TransportError as exc:
            raise ApiUnavailableError(
                f"the Kubernetes API did not answer (deadline {self.request_timeout_s:g} s): {exc}"
            ) from exc

    def plain(self, obj: Any) -> dict[str, Any]:
        plain = self.api_client.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return cast(dict[str, Any], plain)

    # -- custom resources (JobSet, TrainJob) ----------------------------------------------------

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

    # -- pods and nodes ---------------------------------------------------------------------------

    def pods(self, ns: str, jobset: str) -> list[dict[str, Any]]:
        return self.pods_labelled(ns, f"{k8s_plan.JOBSET_NAME}={jobset}")

    def pods_labelled(self, ns: str, selector: str) -> list[dict[str, Any]]:
        """Pods by label selector (a server may ignore the selector: callers filter again)."""
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

    def patch_node(self, name: str, build: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Patch node `name` with `build(its fresh state)`, read again on every retry (the body
        carries the resourceVersion it was built from)."""
        self.call(lambda: self.core.patch_node(name, build(self.read_node(name))))

    def evict(self, ns: str, pod: str) -> bool:
        """The Eviction API on `pod`; False when the pod is gone already (404)."""
        body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=pod, namespace=ns))
        try:
            self.call(lambda: self.core.create_namespaced_pod_eviction(pod, ns, body))
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False
        return True

    def pod_log(self, ns: str, pod: str) -> str:
        # Raw bytes: a log is text whatever content type the server names it with.
        raw: Any = self.call(
            lambda: self.core.read_namespaced_pod_log(pod, ns, _preload_content=False)
        )
        return bytes(raw.data).decode(errors="replace")

    def exec(self, ns: str, pod: str, command: list[str]) -> str:
        """`command` in the pod's first container; its stdout and stderr."""
        from kubernetes.stream import stream

        return str(
            stream(
                self.core.connect_get_namespaced_pod_exec,
                pod,
                ns,
                command=command,
                stderr=True,
                stdout=True,
                stdin=False,
                tty=False,
                # A number: the exec stream takes one timeout, not (connect, read).
                _request_timeout=self.request_timeout_s,
            )
        )

    # -- Jobs (the node diagnostics) --------------------------------------------------------------

    def create_job(self, ns: str, body: dict[str, Any]) -> None:
        self.call(lambda: self.batch.create_namespaced_job(ns, cast(Any, body)))

    def job_status(self, ns: str, name: str) -> dict[str, Any]:
        job = self.call(lambda: self.batch.read_namespaced_job(name, ns))
        return cast(dict[str, Any], self.plain(job).get("status") or {})

    def _items(self, fn: Callable[[], Any]) -> list[dict[str, Any]]:
        """A list call's items as plain JSON: the client's model classes cost ~1 ms a pod to build
        and convert back, which a 1,000-pod job pays on every poll."""
        raw = self.call(fn)
        return list(json.loads(raw.data).get("items") or [])


def bound_requests(api_client: k8s.ApiClient, seconds: float) -> None:
    """Give every request `api_client` makes that names no timeout of its own a deadline of
    `seconds` to connect and as long to read (the client's default is none)."""
    call_api = api_client.call_api

    def bounded(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = (seconds, seconds)
        return call_api(*args, **kwargs)

    api_client.call_api = bounded  # type: ignore[method-assign]


def _message(exc: ApiException) -> str:
    """The API server's own message from an error answer (its Status body), else its reason."""
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


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
            lease = self.api.plain(
                self.api.answered(
                    lambda: coordination.read_namespaced_lease(self.name, self.namespace)
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                self.api.answered(
                    lambda: coordination.create_namespaced_lease(
                        self.namespace, cast(Any, self._body(None))
                    )
                )
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
