"""Synthetic node agents for the dashboard tests and bench/dashboards.py: the agent's real
exporter (`vigil.agent.exporter.AgentCollector`) fed synthetic pages and GPU readings, served
over HTTP by prometheus-client, so Prometheus scrapes exactly what a node agent would expose.

GPU readings come from the agent's real `NvmlSampler` driving `StandInNvml`, a stand-in for
nvidia-ml-py (no GPU or NVML library exists on these machines) with NVML's documented units
(clocks in MHz, power in mW, PCIe in KB/s); the values vary per device and over time.
"""

# ruff: noqa: N802, N815 - the stand-in mirrors nvidia-ml-py's function names
from __future__ import annotations

import math
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from vigil import schema
from vigil.agent import exporter, progress, sampler
from vigil.metric_names import Unit


class StandInNvml:
    """`num_gpus` GPUs; GPU 0 of each node runs hot and throttled when `throttled`."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_MEMORY_ERROR_TYPE_CORRECTED = 1, 0
    NVML_VOLATILE_ECC, NVML_PCIE_UTIL_RX_BYTES, NVML_PCIE_UTIL_TX_BYTES = 0, 1, 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, num_gpus: int, *, node: str, throttled: bool = False) -> None:
        self.num_gpus, self.node, self.throttled = num_gpus, node, throttled

    def _wave(self, h: int) -> float:
        return 0.5 + 0.5 * math.sin(time.monotonic() / 7.0 + h)

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return self.num_gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-{self.node}-{h}".encode()

    def nvmlEventSetCreate(self) -> None:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # XID events: counted as 0

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return types.SimpleNamespace(gpu=int(80 + 15 * self._wave(h)), memory=40)

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        if kind == self.NVML_CLOCK_MEM:
            return 2619
        return 1410 if self.throttled and h == 0 else 1980

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return types.SimpleNamespace(used=int((60 + 10 * self._wave(h)) * 2**30), total=141 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return int(550_000 + 100_000 * self._wave(h))

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 88 if self.throttled and h == 0 else 65 + h % 5

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return 0x40 if self.throttled and h == 0 else 0  # HW thermal slowdown

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return 0

    def nvmlDeviceGetPcieThroughput(self, h: int, kind: int) -> int:
        return int(2_000_000 + 500_000 * self._wave(h))  # KB/s

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return []


def page(
    *, job: str, node: str, rank: int, world: int, step: int, step_time_s: float,
    comm_wait_s: float, mfu: float, tokens: int, now_s: float,
) -> progress.PageSnapshot:  # fmt: skip
    """A rank's page as the agent reads it, mid-training."""
    last = progress.StepSummary(
        step=step, step_time_s=step_time_s, mfu=mfu, comm_wait_s=comm_wait_s,
        collective_s=comm_wait_s * 1.2, end_wall_s=now_s, tokens=tokens, loss=2.0,
    )  # fmt: skip
    return progress.PageSnapshot(
        path=Path(f"/dev/shm/vigil/{job}/rank-{rank:05d}.page"), job=job, node=node, rank=rank,
        world_size=world, local_rank=rank % 8, pid=10_000 + rank, capacity=1024,
        state=schema.RankState.COMPUTE, last_step=step, progress_mono_s=now_s,
        progress_wall_s=now_s, step_start_mono_s=now_s, last_group="world", last_seq=step,
        last_op="all_reduce", ring_head=0, last=last, health=progress.Health(),
    )  # fmt: skip


class Exporter:
    """One synthetic node agent on loopback: `view()` is called on every scrape."""

    def __init__(self, view: Callable[[], exporter.AgentView]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(exporter.AgentCollector(view))
        self._server, self._thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = int(self._server.server_address[1])
        self.target = f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


ViewFn = Callable[[], exporter.AgentView]


def gpu_view(node: str, owners: list[tuple[str, int, str]], *, throttled: bool = False) -> ViewFn:
    """GPU readings for one GPU per owner (job, rank, pod), sampled fresh on every scrape."""
    gpus = sampler.NvmlSampler(StandInNvml(len(owners), node=node, throttled=throttled))
    lock = threading.Lock()
    uuids = [f"GPU-{node}-{i}" for i in range(len(owners))]
    attributed = {
        uuid: sampler.Owner(job=job, rank=rank, pod=pod)
        for uuid, (job, rank, pod) in zip(uuids, owners, strict=True)
    }

    def view() -> exporter.AgentView:
        with lock:
            readings = gpus.sample()
        return exporter.AgentView(node=node, readings=readings, owners=attributed)

    return view


def host_readings(node: str, now_s: float) -> list[sampler.Reading]:
    """A node's host readings as the agent's HostSampler reports them."""
    wave = 0.5 + 0.5 * math.sin(now_s / 11.0 + len(node))
    return [
        sampler.Reading("host", "cpu_utilization", Unit.RATIO, 0.3 + 0.4 * wave),
        sampler.Reading("host", "memory_used", Unit.BYTES, 512e9 + 64e9 * wave),
        sampler.Reading("host", "memory_available", Unit.BYTES, 1.5e12 - 64e9 * wave),
        sampler.Reading("host", "network_receive", Unit.BYTES_PER_SECOND, 1e9 * wave),
        sampler.Reading("host", "network_transmit", Unit.BYTES_PER_SECOND, 1e9 * wave),
    ]


def node_view(
    *, job: str, node: str, ranks: list[int], world: int, stragglers: set[int], started_s: float
) -> ViewFn:
    """One node of a training job: its ranks' pages (1 s steps; a rank in the job's
    `stragglers` computes 0.4 s longer and every other rank waits for it), its GPUs (one per
    rank; GPU 0 throttled on a straggler's node) and its host."""
    owners = [(job, r, f"{job}-worker-{r // 8}") for r in ranks]
    gpus = gpu_view(node, owners, throttled=bool(stragglers & set(ranks)))

    def view() -> exporter.AgentView:
        now = time.time()
        step = int(now - started_s)
        slow = 0.4 if stragglers else 0.0
        pages = []
        for r in ranks:
            jitter = 0.02 * math.sin(step * 0.7 + r)
            compute = 0.6 + jitter + (slow if r in stragglers else 0.0)
            step_time = 0.6 + slow + 0.3 + 0.02  # the slowest rank's compute + communication
            pages.append(
                exporter.RankView(
                    snapshot=page(
                        job=job, node=node, rank=r, world=world, step=step,
                        step_time_s=step_time, comm_wait_s=max(0.0, step_time - compute),
                        mfu=0.45 * compute / step_time, tokens=8192, now_s=now,
                    ),
                    progress_age_s=now - (started_s + step),
                    hung=False,
                )
            )  # fmt: skip
        base = gpus()
        return exporter.AgentView(
            node=node,
            ranks=pages,
            readings=[*base.readings, *host_readings(node, now)],
            owners=base.owners,
        )

    return view
