"""The agent's sampling and /metrics exposition, and GPU attribution to the rank using a device.

No GPU or NVML library exists on this machine, so the NVML test drives `NvmlSampler` with a small
stand-in module exposing the nvidia-ml-py functions it calls (documented NVML semantics: clocks in
MHz, power in mW, PCIe throughput in KB/s). The page, the agent and the exposition are real.
"""

# ruff: noqa: N802, N815 - the stand-in mirrors nvidia-ml-py's function names
from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from vigil import schema
from vigil.agent import config, daemon, progress, sampler


class _Nvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_MEMORY_ERROR_TYPE_CORRECTED = 1, 0
    NVML_VOLATILE_ECC, NVML_PCIE_UTIL_RX_BYTES, NVML_PCIE_UTIL_TX_BYTES = 0, 1, 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h: str) -> bytes:
        return b"GPU-1234"

    def nvmlEventSetCreate(self) -> None:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        return types.SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
        return 1980 if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        return types.SimpleNamespace(used=40 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 612_000

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        return 71

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: str) -> int:
        return 0x4  # SW power cap

    def nvmlDeviceGetTotalEccErrors(self, h: str, kind: int, counter: int) -> int:
        return 0 if kind == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 3

    def nvmlDeviceGetPcieThroughput(self, h: str, kind: int) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # left out, not fatal

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[Any]:
        return [types.SimpleNamespace(pid=self.pid, usedGpuMemory=1)]


def _page(tmp_path: Path) -> progress.PageWriter:
    writer = progress.PageWriter(
        progress.page_path(tmp_path / "pages", "gpt", 5, "run-1"),
        job="gpt",
        node="n7",
        rank=5,
        world_size=8,
        local_rank=5,
        capacity=16,
    )
    writer.progress(schema.RankState.COMPUTE, now_mono=1.0, now_wall=1.0, step=41)
    writer.step_done(step=41, step_time_s=1.25, mfu=0.41, comm_wait_s=0.2)
    return writer


def test_gpu_samples_are_attributed_to_the_rank_using_the_device(tmp_path: Path) -> None:
    writer = _page(tmp_path)
    pid = progress.PageReader(writer.path).pid
    cfg = config.AgentConfig(node="n7", progress_dir=tmp_path / "pages", output_dir=tmp_path)
    agent = daemon.Agent(cfg, gpus=sampler.NvmlSampler(_Nvml(pid)), clock=lambda: 3.0)
    agent.poll()
    agent.sample()
    text = generate_latest(agent.registry).decode()
    labels = 'device="GPU-1234",job_id="gpt",node="n7",pod="",rank="5"'
    assert f"vigil_gpu_utilization_ratio{{{labels}}} 0.87" in text
    assert f"vigil_gpu_sm_clock_hertz{{{labels}}} 1.98e+09" in text
    assert f"vigil_gpu_power_watts{{{labels}}} 612.0" in text
    assert f"vigil_gpu_ecc_corrected_errors_total{{{labels}}} 3.0" in text
    assert "pcie" not in text  # unsupported counters are left out
    assert 'vigil_sdk_step_time_seconds{job_id="gpt",node="n7",rank="5"} 1.25' in text
    assert 'vigil_sdk_progress_age_seconds{job_id="gpt",node="n7",rank="5"} 2.0' in text
    assert 'vigil_host_memory_used_bytes{node="n7"}' in text
    samples = [r for r in agent.queue.drain() if isinstance(r, schema.Sample)]
    power = next(s for s in samples if s.metric == "vigil_gpu_power_watts")
    assert (power.job_id, power.rank, power.device, power.value) == ("gpt", 5, "GPU-1234", 612.0)
    agent.flusher.stop()
    writer.close()


def test_a_rank_that_died_is_reported_once_and_its_page_removed(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from vigil import schema\n"
        "from vigil.agent import progress\n"
        "w = progress.PageWriter(progress.page_path(Path(sys.argv[1]), 'gpt', 2, 'run-1'),"
        " job='gpt', node='n7', rank=2, world_size=4, local_rank=2, capacity=16)\n"
        "w.progress(schema.RankState.COMPUTE, now_mono=1.0, now_wall=time.time(), step=12)\n"
        "w.write_event(0, seq=30, step=12, nbytes=64, enqueue_s=1.0, start_s=1.0, end_s=0.0,"
        " group='world', op='all_gather_single', dtype='bfloat16')\n"
        "w.collective('world', 30, 'all_gather_single', entering=True, now_mono=1.0,"
        " now_wall=time.time())\n"
    )
    subprocess.run([sys.executable, "-c", script, str(pages)], check=True, timeout=60)
    page = progress.page_path(pages, "gpt", 2, "run-1")
    cfg = config.AgentConfig(node="n7", progress_dir=pages, output_dir=tmp_path, page_ttl_s=1e9)
    agent = daemon.Agent(cfg, gpus=None)
    agent.poll()
    agent.poll()  # reported once, not on every poll
    records = agent.queue.drain()
    (crash,) = [r for r in records if isinstance(r, schema.Finding)]
    assert crash.kind is schema.FindingKind.CRASH and crash.subjects.ranks == [2]
    assert "step 12" in crash.summary and "all_gather_single" in crash.summary
    assert [e.seq for e in records if isinstance(e, schema.CollectiveEvent)] == [30]
    assert agent.hangs_detected == 0 and page.exists()
    agent.cfg = dataclasses.replace(cfg, page_ttl_s=0.0)
    agent.poll()
    assert not page.exists() and agent.view().ranks == []
    agent.flusher.stop()
