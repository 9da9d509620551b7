"""GPU -> pod attribution from the kubelet's pod-resources API, against a real gRPC server.

A grpcio server on a unix socket serves the generated `v1.PodResourcesLister` with the List
answer in data/podresources_list.txtpb (the shape a kubelet on an 8-GPU node gives: GPUs by
UUID, listed in allocation order, beside MIG slices, RDMA devices and CPU-only pods). The
agent's client, sampler and daemon are real; NVML is a stand-in (no GPU here) whose process list
holds host pids the ranks' pages never show, as on Kubernetes without hostPID.
"""

# ruff: noqa: N802 - the stand-ins mirror nvidia-ml-py's and grpc's names
from __future__ import annotations

import logging
import re
import time
import types
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

grpc = pytest.importorskip("grpc")

from google.protobuf import text_format  # noqa: E402 - after the importorskip

from vigil import schema  # noqa: E402
from vigil.agent import (  # noqa: E402
    config,
    daemon,
    podresources,
    podresources_v1_pb2,
    podresources_v1_pb2_grpc,
    progress,
    sampler,
)

RECORDED = Path(__file__).parent / "data" / "podresources_list.txtpb"
TRAINING_POD = "llama-workers-0-1-x7k2p"


def _recorded() -> Any:
    return text_format.Parse(RECORDED.read_text(), podresources_v1_pb2.ListPodResourcesResponse())


class _Kubelet(podresources_v1_pb2_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, response: Any) -> None:
        self.response = response
        self.calls = 0
        self.delay_s = 0.0

    def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        time.sleep(self.delay_s)
        return self.response


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[tuple[_Kubelet, Path]]:
    sock = tmp_path / "kubelet.sock"
    servicer = _Kubelet(_recorded())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    podresources_v1_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield servicer, sock
    server.stop(grace=None)


class _Nvml:
    """Four GPUs GPU-0..GPU-3; their process lists hold host pids (`host_pids`)."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, host_pids: dict[int, int] | None = None) -> None:
        self.host_pids = host_pids or {}

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h: str) -> bytes:
        return f"GPU-{h[1:]}".encode()

    def nvmlEventSetCreate(self) -> None:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        return types.SimpleNamespace(gpu=10 * (int(h[1:]) + 1), memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[Any]:
        pid = self.host_pids.get(int(h[1:]))
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=1)] if pid else []


def _pages(root: Path, run: str, ranks: dict[int, int]) -> list[progress.PageWriter]:
    """Pages of job llama (rank -> local rank) in run folder `run`, as the SDK writes them."""
    writers = []
    for rank, local_rank in ranks.items():
        writer = progress.PageWriter(
            progress.page_path(root, "llama", rank, run),
            job="llama",
            node="gpu-node-7",
            rank=rank,
            world_size=16,
            local_rank=local_rank,
            capacity=16,
        )
        writer.progress(schema.RankState.COMPUTE, now_mono=1.0, now_wall=1.0, step=3)
        writers.append(writer)
    return writers


def test_the_client_lists_each_pods_gpus_from_the_kubelet_socket(
    kubelet: tuple[_Kubelet, Path],
) -> None:
    servicer, sock = kubelet
    client = podresources.PodResourcesClient(sock, refresh_s=60.0)
    try:
        devices = client.read()
        assert [(d.namespace, d.pod, d.container, d.device_id) for d in devices] == [
            ("training", TRAINING_POD, "trainer", "GPU-3"),
            ("training", TRAINING_POD, "trainer", "GPU-1"),
            ("research", "eval-7f9c4", "eval", "GPU-0"),
        ]  # MIG slices, RDMA devices and CPU-only pods are not GPUs
        assert client.read() == devices and servicer.calls == 1  # cached for refresh_s
    finally:
        client.close()


def test_a_kubelet_that_does_not_answer_costs_one_timeout_and_is_logged_once(
    kubelet: tuple[_Kubelet, Path], caplog: pytest.LogCaptureFixture
) -> None:
    servicer, sock = kubelet
    now = [0.0]
    client = podresources.PodResourcesClient(
        sock, timeout_s=0.2, refresh_s=5.0, clock=lambda: now[0]
    )
    try:
        first = client.devices()
        assert len(first) == 3
        servicer.delay_s = 1.0
        now[0] = 10.0
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="vigil.agent.podresources"):
            assert client.devices() == first  # the last good answer
            assert time.monotonic() - started < 0.9
            assert client.devices() == first  # within refresh_s of the failure: no new call
        assert servicer.calls == 2
        warnings = [r.message for r in caplog.records if "unavailable" in r.message]
        assert len(warnings) == 1 and "DEADLINE_EXCEEDED" in warnings[0]
    finally:
        servicer.delay_s = 0.0
        client.close()


def test_open_client_without_a_socket_is_none(tmp_path: Path) -> None:
    assert podresources.open_client(tmp_path / "missing.sock") is None


def test_every_gpu_sample_carries_job_rank_and_pod(
    kubelet: tuple[_Kubelet, Path], tmp_path: Path
) -> None:
    _, sock = kubelet
    pages = tmp_path / "pages"
    # The training pod runs ranks 6 and 7 (local ranks 0 and 1) and names its run after itself.
    writers = _pages(pages, TRAINING_POD, {6: 0, 7: 1})
    client = podresources.PodResourcesClient(sock)
    gpus = sampler.NvmlSampler(_Nvml(host_pids={1: 424242}), pods=client)
    cfg = config.AgentConfig(node="gpu-node-7", progress_dir=pages, output_dir=tmp_path)
    agent = daemon.Agent(cfg, gpus=gpus, clock=lambda: 3.0)
    try:
        agent.poll()
        agent.sample()
        samples = [
            r
            for r in agent.queue.drain()
            if isinstance(r, schema.Sample) and r.metric == "vigil_gpu_utilization_ratio"
        ]
        owners = {s.device: (s.job_id, s.rank, s.pod) for s in samples}
        assert owners == {
            # The pod's GPUs in NVML order (GPU-1 before GPU-3) to its local ranks in order.
            "GPU-1": ("llama", 6, TRAINING_POD),
            "GPU-3": ("llama", 7, TRAINING_POD),
            "GPU-0": ("", -1, "eval-7f9c4"),  # a pod without vigil: the pod alone
            "GPU-2": ("", -1, ""),  # allocated to nobody
        }
        text = generate_latest(agent.registry).decode()
        labels = f'device="GPU-3",job_id="llama",node="gpu-node-7",pod="{TRAINING_POD}",rank="7"'
        assert f"vigil_gpu_utilization_ratio{{{labels}}} 0.4" in text  # /metrics says it too
        # The chart scrapes agents with honorLabels (pod = the training pod): no series may carry
        # a job label, which would override the scrape job vigil's alerts select on.
        assert not re.search(r'[{,]job="', text)
    finally:
        agent.flusher.stop()
        gpus.close()
        for writer in writers:
            writer.close()


def test_attribution_rules() -> None:
    uuids = ["GPU-a", "GPU-b", "GPU-c"]

    def dev(pod: str, device_id: str) -> podresources.PodDevice:
        return podresources.PodDevice(
            pod=pod, namespace="ns", container="c", resource="nvidia.com/gpu", device_id=device_id
        )

    rank = sampler.Owner("job", 3, run="some-run", local_rank=0)
    # One GPU pod and one run on the node: the run is the pod's even when it is named otherwise;
    # the device plugin's index strategy names GPUs by NVML index.
    assert sampler.attribute(uuids, [dev("p", "0"), dev("p", "2")], {}, [rank]) == {
        "GPU-a": sampler.Owner("job", 3, pod="p", run="some-run", local_rank=0),
        "GPU-c": sampler.Owner("job", 3, pod="p", run="some-run", local_rank=0),
    }
    # NVML's process match with one of the pod's ranks wins (it names the rank); the pod is added.
    ranks = [sampler.Owner("job", r, run="p", local_rank=r) for r in (8, 9, 10)]
    by_pid = {"GPU-b": ranks[1]}
    found = sampler.attribute(uuids, [dev("p", "GPU-b"), dev("p", "GPU-c")], by_pid, ranks)
    assert (found["GPU-b"].rank, found["GPU-b"].pod) == (9, "p")
    # A pid match with a rank of another pod is a PID-namespace coincidence: ignored.
    other = sampler.Owner("job", 1, run="elsewhere", local_rank=0)
    found = sampler.attribute(uuids, [dev("p", "GPU-b")], {"GPU-b": other}, [*ranks[:1], other])
    assert found["GPU-b"] == sampler.Owner("job", 8, pod="p", run="p", local_rank=8)
    # Two pods: ranks go only to the pod their run folder is named after.
    assert sampler.attribute(uuids, [dev("p", "GPU-a"), dev("q", "GPU-b")], {}, [rank]) == {
        "GPU-a": sampler.Owner("", -1, pod="p"),
        "GPU-b": sampler.Owner("", -1, pod="q"),
    }
    # Device ids that are neither this node's UUIDs nor indexes are ignored.
    assert sampler.attribute(uuids, [dev("p", "GPU-zzz"), dev("p", "9")], {}, [rank]) == {}


def test_the_agent_runs_without_grpcio(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sock = tmp_path / "kubelet.sock"
    sock.touch()
    monkeypatch.setitem(__import__("sys").modules, "grpc", None)  # import grpc raises ImportError
    assert podresources.open_client(sock) is None


def test_sampling_does_not_wait_on_a_kubelet_longer_than_the_timeout(
    kubelet: tuple[_Kubelet, Path],
) -> None:
    servicer, sock = kubelet
    servicer.delay_s = 2.0
    client = podresources.PodResourcesClient(sock, timeout_s=0.3)
    gpus = sampler.NvmlSampler(_Nvml(), pods=client)
    try:
        started = time.monotonic()
        gpus.owners({})
        assert time.monotonic() - started < 1.5
    finally:
        servicer.delay_s = 0.0
        gpus.close()


def test_the_committed_client_is_what_grpcio_tools_generates_from_the_vendored_proto(
    tmp_path: Path,
) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    root = Path(__file__).resolve().parents[2]
    status = protoc.main(
        [
            "protoc",
            f"-Ivigil/agent={root / 'agent'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            "vigil/agent/podresources_v1.proto",
        ]
    )
    assert status == 0
    for name in (
        "podresources_v1_pb2.py",
        "podresources_v1_pb2.pyi",
        "podresources_v1_pb2_grpc.py",
    ):
        generated = (tmp_path / "vigil" / "agent" / name).read_text()
        assert generated == (root / "agent" / name).read_text(), (
            f"agent/{name} differs from grpcio-tools' output: bash agent/podresources_v1_regen.sh"
        )
