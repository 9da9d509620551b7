"""GPU (NVML through nvidia-ml-py) and host (psutil) sampling for the node agent.

`Reading`s carry the Prometheus name parts; the agent turns them into `schema.Sample` records
(metric = the full Prometheus name) and gauges. GPU readings are attributed to the job, rank and
pod whose process uses the device: NVML's running-process list matched against the progress pages'
pids, and on Kubernetes the kubelet's pod-resources answer (agent/podresources.py: which pod holds
which GPU) joined with the pages' run folders and local ranks (`attribute`). Without NVML the
agent says so once and samples only the host. The NVML module, psutil and the pod-resources
client are injected so tests can pass their own. No files; the only I/O is through them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from vigil.agent import podresources
from vigil.metric_names import MetricKind, Unit, metric_name

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Reading:
    subsystem: str
    name: str
    unit: Unit
    value: float
    device: str = ""
    kind: MetricKind = MetricKind.GAUGE

    @property
    def metric(self) -> str:
        return metric_name(self.subsystem, self.name, self.unit, self.kind)


@dataclasses.dataclass(frozen=True)
class Owner:
    job: str
    rank: int
    pod: str = ""
    # The rank's progress folder (<root>/<job>/<run>/) and LOCAL_RANK, for the pod join: a
    # training pod names its run after itself (VIGIL_RUN_ID from metadata.name).
    run: str = ""
    local_rank: int = -1


def attribute(
    uuids: list[str],
    devices: list[podresources.PodDevice],
    by_pid: Mapping[str, Owner],
    ranks: list[Owner],
) -> dict[str, Owner]:
    """GPU UUID -> owner, from the kubelet's allocations (`devices`) and the node's ranks.

    The pod's ranks are those whose run folder is named after the pod (or, when the node runs one
    GPU pod and one run, that run's). A GPU NVML tied to one of them by process id keeps that rank
    (a pid match with a rank of another pod is a coincidence of PID namespaces and is ignored);
    else one rank owns all of its pod's GPUs, and n ranks on n GPUs are matched in order: the
    i-th LOCAL_RANK uses the pod's i-th GPU in NVML (PCI bus) order, the order CUDA enumerates a
    container's identical GPUs in. Other GPUs of a pod carry the pod alone (job "", rank -1);
    GPUs the kubelet gave no pod keep their process match.
    """
    index = {uuid: i for i, uuid in enumerate(uuids)}

    def uuid_of(device_id: str) -> str | None:
        if device_id in index:
            return device_id
        if device_id.isdigit() and int(device_id) < len(uuids):  # the plugin's index strategy
            return uuids[int(device_id)]
        return None

    pods: dict[tuple[str, str], list[str]] = {}
    for device in devices:
        uuid = uuid_of(device.device_id)
        if uuid is not None:
            pods.setdefault((device.namespace, device.pod), []).append(uuid)
    runs = {owner.run for owner in ranks}
    found = dict(by_pid)
    for (_, pod), pod_uuids in pods.items():
        mine = [owner for owner in ranks if owner.run == pod]
        if not mine and len(pods) == 1 and len(runs) == 1:
            mine = list(ranks)
        mine.sort(key=lambda owner: (owner.local_rank, owner.rank))
        for i, uuid in enumerate(sorted(set(pod_uuids), key=index.__getitem__)):
            if uuid in by_pid and by_pid[uuid] in mine:
                owner = by_pid[uuid]
            elif len(mine) == 1:
                owner = mine[0]
            elif len(mine) == len(pod_uuids):
                owner = mine[i]
            else:
                owner = Owner("", -1)
            found[uuid] = dataclasses.replace(owner, pod=pod)
    return found


class HostSampler:
    """CPU, memory and network of the host (psutil)."""

    def __init__(self, *, ps: Any = psutil, clock: Callable[[], float] = time.monotonic) -> None:
        self._ps = ps
        self._clock = clock
        self._ps.cpu_percent(interval=None)  # primes the CPU counter
        self._net: tuple[float, Any] | None = None

    def sample(self) -> list[Reading]:
        memory = self._ps.virtual_memory()
        readings = [
            Reading("host", "cpu_utilization", Unit.RATIO, self._ps.cpu_percent(None) / 100.0),
            Reading("host", "memory_used", Unit.BYTES, float(memory.used)),
            Reading("host", "memory_available", Unit.BYTES, float(memory.available)),
        ]
        now, net = self._clock(), self._ps.net_io_counters()
        if self._net is not None and now > self._net[0]:
            elapsed = now - self._net[0]
            readings += [
                Reading(
                    "host",
                    "network_receive",
                    Unit.BYTES_PER_SECOND,
                    (net.bytes_recv - self._net[1].bytes_recv) / elapsed,
                ),
                Reading(
                    "host",
                    "network_transmit",
                    Unit.BYTES_PER_SECOND,
                    (net.bytes_sent - self._net[1].bytes_sent) / elapsed,
                ),
            ]
        self._net = (now, net)
        return readings


class NvmlSampler:
    """Per GPU: utilisation, clocks, memory, power, temperature, ECC, XID, throttling, PCIe."""

    def __init__(self, nvml: Any, *, pods: podresources.PodResourcesClient | None = None) -> None:
        self._nvml = nvml
        self._pods = pods
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._index_of = {_handle_key(h): i for i, h in enumerate(self._handles)}
        self._events = self._xid_events()
        self.xid_counts = [0] * count

    def _xid_events(self) -> Any:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            return events
        except Exception as exc:  # not supported on every board/driver
            log.info("NVML XID events unavailable: %s", exc)
            return None

    def owners(
        self, pids: Mapping[int, Owner], ranks: list[Owner] | None = None
    ) -> dict[str, Owner]:
        """Device UUID -> the job/rank (and on Kubernetes the pod) using it; `ranks`: every rank
        with a page on this node (default: those in `pids`), for the pod-resources join."""
        found: dict[str, Owner] = {}
        for uuid, handle in zip(self._uuids, self._handles, strict=True):
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            for proc in procs:
                if proc.pid in pids:
                    found[uuid] = pids[proc.pid]
        if self._pods is not None:
            ranks = list(pids.values()) if ranks is None else ranks
            found = attribute(self._uuids, self._pods.devices(), found, ranks)
        return found

    def sample(self) -> list[Reading]:
        self._drain_xids()
        readings: list[Reading] = []
        for index, handle in enumerate(self._handles):
            readings += self._device(handle, self._uuids[index], index)
        return readings

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        nvml = self._nvml
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: no event pending
                return
            index = self._index_of.get(_handle_key(data.device))
            if index is None:
                log.warning("XID %s on a GPU this agent does not sample", data.eventData)
                continue
            self.xid_counts[index] += 1
            log.warning("XID %s on GPU %s", data.eventData, self._uuids[index])

    def _device(self, handle: Any, uuid: str, index: int) -> list[Reading]:
        nvml = self._nvml
        probes: list[tuple[str, Unit, Callable[[], float], MetricKind]] = [
            (
                "utilization",
                Unit.RATIO,
                lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
                MetricKind.GAUGE,
            ),
            (
                "sm_clock",
                Unit.HERTZ,
                lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6,
                MetricKind.GAUGE,
            ),
            (
                "memory_clock",
                Unit.HERTZ,
                lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM) * 1e6,
                MetricKind.GAUGE,
            ),
            (
                "memory_used",
                Unit.BYTES,
                lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used,
                MetricKind.GAUGE,
            ),
            (
                "power",
                Unit.WATTS,
                lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                MetricKind.GAUGE,
            ),
            (
                "temperature",
                Unit.CELSIUS,
                lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                MetricKind.GAUGE,
            ),
            (
                "throttle_reasons",
                Unit.NONE,
                lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle),
                MetricKind.GAUGE,
            ),
            (
                "ecc_uncorrected_errors",
                Unit.NONE,
                lambda: nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                ),
                MetricKind.COUNTER,
            ),
            (
                "ecc_corrected_errors",
                Unit.NONE,
                lambda: nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC
                ),
                MetricKind.COUNTER,
            ),
            (
                "pcie_receive",
                Unit.BYTES_PER_SECOND,
                lambda: (
                    nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024
                ),
                MetricKind.GAUGE,
            ),
            (
                "pcie_transmit",
                Unit.BYTES_PER_SECOND,
                lambda: (
                    nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024
                ),
                MetricKind.GAUGE,
            ),
            ("xid_events", Unit.NONE, lambda: self.xid_counts[index], MetricKind.COUNTER),
        ]
        readings = []
        for name, unit, probe, kind in probes:
            try:
                readings.append(Reading("gpu", name, unit, float(probe()), uuid, kind))
            except Exception:  # the board or driver lacks this counter: leave it out
                continue
        return readings

    def close(self) -> None:
        if self._pods is not None:
            self._pods.close()
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)


def _handle_key(handle: Any) -> object:
    """A device handle by value. nvidia-ml-py's handles are ctypes pointers, which compare by
    object identity, and each read of an event's `device` field is a fresh pointer object: the
    address it holds names the device. Other handles (stand-ins) are their own key."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def open_nvml(*, enabled: bool) -> NvmlSampler | None:
    """An NVML sampler, or None (logged once) when NVML or its driver library is unavailable."""
    if not enabled:
        log.info("NVML sampling disabled: sampling the host only")
        return None
    pods = None
    try:
        import pynvml  # provided by nvidia-ml-py

        pods = podresources.open_client()
        return NvmlSampler(pynvml, pods=pods)
    except Exception as exc:
        if pods is not None:
            pods.close()
        log.warning("NVML unavailable (%s): no GPU metrics, sampling the host with psutil", exc)
        return None
