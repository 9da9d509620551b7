"""Which pod holds which GPU on this node: the kubelet's pod-resources API (gRPC, unix socket).

The kubelet serves `v1.PodResourcesLister` on /var/lib/kubelet/pod-resources/kubelet.sock
(`$VIGIL_POD_RESOURCES_SOCKET`); its List answer names, per pod and container, the device ids the
device plugin allocated: GPU UUIDs (`nvidia.com/gpu`, the NVIDIA plugin's default id strategy) or
NVML indexes (its `index` strategy). The node agent's NVML sampler joins them with the progress
pages (sampler.attribute) so each GPU sample carries job, rank and pod.

grpcio is optional (the `k8s` extra) and imported only when a client opens; without it, or
without the socket (not a Kubernetes node), `open_client` says so once and returns None. The
client is generated from the vendored upstream proto (agent/podresources_v1.proto;
agent/podresources_v1_regen.sh regenerates it). Reads the socket only: no NVML, no pages, no
Kubernetes API.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vigil.env import EnvVar

log = logging.getLogger(__name__)

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# Extended resources that are whole GPUs. MIG slices (nvidia.com/mig-*) are left out: the agent
# samples whole boards, and a board shared by several pods' slices belongs to none of them.
GPU_RESOURCES = frozenset({"nvidia.com/gpu", "nvidia.com/gpu.shared", "amd.com/gpu"})
# The kubelet answers List from memory in well under a second; a hung kubelet must not stall
# sampling, which waits for this call.
DEFAULT_TIMEOUT_S = 2.0
# Allocations change when pods start or end; re-reading every 10 s bounds how long a new pod's
# GPUs go unattributed without a gRPC call per sample.
DEFAULT_REFRESH_S = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodDevice:
    """One GPU allocated to a container; `device_id` as the device plugin names it (a GPU UUID,
    or an NVML index)."""

    pod: str
    namespace: str
    container: str
    resource: str
    device_id: str


def gpu_devices(response: Any) -> list[PodDevice]:
    """The GPUs in a `ListPodResourcesResponse`, in the order the kubelet lists them."""
    found = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name not in GPU_RESOURCES:
                    continue
                found += [
                    PodDevice(
                        pod=pod.name,
                        namespace=pod.namespace,
                        container=container.name,
                        resource=devices.resource_name,
                        device_id=device_id,
                    )
                    for device_id in devices.device_ids
                ]
    return found


class PodResourcesClient:
    """A List client over the kubelet's socket, with a per-call timeout and a short cache."""

    def __init__(
        self,
        socket_path: Path = DEFAULT_SOCKET,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        import grpc  # the k8s extra; imported here so the agent runs without it

        from vigil.agent import podresources_v1_pb2 as pb
        from vigil.agent import podresources_v1_pb2_grpc as pb_grpc

        self.socket_path = Path(socket_path)
        self._timeout_s = timeout_s
        self._refresh_s = refresh_s
        self._clock = clock
        self._grpc = grpc
        self._request = pb.ListPodResourcesRequest()
        self._channel = grpc.insecure_channel(f"unix://{self.socket_path.absolute()}")
        self._stub = pb_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]
        self._cached: list[PodDevice] = []
        self._read_at: float | None = None
        self._failing = False

    def read(self) -> list[PodDevice]:
        """The node's GPU allocations, at most refresh_s old. Raises on a failed call."""
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self._refresh_s:
            response = self._stub.List(self._request, timeout=self._timeout_s)
            self._cached = gpu_devices(response)
            self._read_at = now
        return self._cached

    def devices(self) -> list[PodDevice]:
        """`read()`, or the last good answer (empty at first) when the kubelet does not answer;
        a failure is logged once until a call succeeds again."""
        try:
            found = self.read()
        except self._grpc.RpcError as exc:
            if not self._failing:
                log.warning(
                    "kubelet pod-resources at %s unavailable (%s): GPUs keep their last "
                    "attribution",
                    self.socket_path,
                    exc.code() if hasattr(exc, "code") else exc,
                )
            self._failing = True
            self._read_at = self._clock()  # retry after refresh_s, not on every sample
            return self._cached
        if self._failing:
            log.info("kubelet pod-resources at %s answers again", self.socket_path)
            self._failing = False
        return found

    def close(self) -> None:
        self._channel.close()


def socket_path() -> Path:
    return Path(os.environ.get(EnvVar.POD_RESOURCES_SOCKET) or DEFAULT_SOCKET)


def open_client(path: Path | None = None) -> PodResourcesClient | None:
    """A client when the socket exists and grpcio is installed, else None (said once, at start)."""
    path = path or socket_path()
    if not path.exists():
        log.info("no kubelet pod-resources socket at %s: GPUs attributed by process only", path)
        return None
    try:
        return PodResourcesClient(path)
    except ImportError as exc:
        log.warning(
            "kubelet pod-resources socket found but %s is missing (pip install 'vigil[k8s]'): "
            "GPUs attributed by process only",
            exc.name,
        )
        return None
