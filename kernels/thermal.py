"""Clock and thermal stability during a GEMM burn: NVML clocks, throttle reasons, temperature.

`burn` keeps a device busy with back-to-back GEMMs for a while, measuring throughput per
interval and reading a `Sampler` after each: `NvmlSampler` on NVIDIA GPUs (nvidia-ml-py, the
device found by UUID), `HostSampler` (psutil) on CPUs. Clock drops caused by hardware slowdown,
thermal limits or the power brake are counted as faults; a software power cap is how a busy
Hopper normally runs and is not. NVML is optional: without it a GPU burn still reports throughput.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vigil.kernels import devices, measurement

log = logging.getLogger(__name__)

# nvmlClocksEventReason* bits (nvml.h); names as vigil reports them.
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
# Reasons that mean the device cannot hold its clocks: heat, a failing PSU/VRM, a power brake.
FAULT_REASONS = frozenset(
    {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake"}
)


def decode_reasons(mask: int) -> frozenset[str]:
    return frozenset(name for bit, name in REASON_BITS.items() if mask & bit)


@dataclass(frozen=True, kw_only=True)
class ClockSample:
    sm_mhz: float | None = None
    max_sm_mhz: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    reasons: frozenset[str] = frozenset()


class Sampler(Protocol):
    def sample(self) -> ClockSample: ...


class NvmlSampler:
    """Reads one GPU through NVML; `nvml` is the pynvml module (injectable for tests)."""

    def __init__(self, device_uuid: str, *, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml  # nvidia-ml-py

            nvml = pynvml
        self._nvml = nvml
        nvml.nvmlInit()
        self._handle = nvml.nvmlDeviceGetHandleByUUID(device_uuid)

    def sample(self) -> ClockSample:
        n, h = self._nvml, self._handle
        return ClockSample(
            sm_mhz=float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            max_sm_mhz=float(n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)),
            temperature_c=float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
            power_w=n.nvmlDeviceGetPowerUsage(h) / 1000.0,
            reasons=decode_reasons(int(n.nvmlDeviceGetCurrentClocksEventReasons(h))),
        )

    def close(self) -> None:
        self._nvml.nvmlShutdown()


class HostSampler:
    """CPU frequency and the hottest sensor psutil can see (either may be missing in a VM)."""

    def sample(self) -> ClockSample:
        import psutil

        freq = psutil.cpu_freq()
        temps: dict[str, list[Any]] = getattr(psutil, "sensors_temperatures", dict)()
        readings = [t.current for entries in temps.values() for t in entries if t.current]
        return ClockSample(
            sm_mhz=float(freq.current) if freq and freq.current else None,
            max_sm_mhz=float(freq.max) if freq and freq.max else None,
            temperature_c=max(readings) if readings else None,
        )


def sampler_for(target: devices.Target) -> Sampler:
    """NVML for a GPU when it can be initialised, else the host sampler."""
    if target.is_cuda:
        try:
            return NvmlSampler(target.device_id)
        except Exception as exc:  # no driver library, or a GPU NVML cannot see (MIG, container)
            log.warning("NVML unavailable for %s (%s): clocks not sampled", target.device_id, exc)
            return _NullSampler()
    return HostSampler()


class _NullSampler:
    def sample(self) -> ClockSample:
        return ClockSample()


@dataclass(frozen=True, kw_only=True)
class BurnConfig:
    duration_s: float = 30.0
    interval_s: float = 1.0
    size: int = 8192
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or not 0 < self.interval_s <= self.duration_s:
            raise ValueError("burn needs duration_s > 0 and 0 < interval_s <= duration_s")
        if self.size < 1 or self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError("burn needs size >= 1 and dtype fp32, fp16 or bf16")


@dataclass(frozen=True, kw_only=True)
class BurnOutcome:
    interval_tflops: tuple[float, ...]
    samples: tuple[ClockSample, ...]

    @property
    def median_tflops(self) -> float:
        return statistics.median(self.interval_tflops)

    @property
    def throughput_stability(self) -> float:
        """Slowest interval over the median interval: 1.0 is perfectly steady."""
        return min(self.interval_tflops) / self.median_tflops if self.median_tflops else 0.0

    @property
    def fault_samples(self) -> int:
        return sum(1 for s in self.samples if s.reasons & FAULT_REASONS)


def burn(
    target: devices.Target,
    config: BurnConfig,
    sampler: Sampler,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> BurnOutcome:
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[config.dtype]
    if not target.is_cuda:
        dtype = torch.float32
    a = torch.randn(config.size, config.size, device=target.device).to(dtype)
    b = torch.randn(config.size, config.size, device=target.device).to(dtype)
    flops = 2.0 * config.size**3
    tflops: list[float] = []
    samples: list[ClockSample] = []
    end = clock() + config.duration_s
    while clock() < end or not tflops:
        start, count = clock(), 0
        while clock() - start < config.interval_s or count == 0:
            torch.matmul(a, b)
            count += 1
            if target.is_cuda and count % 8 == 0:
                torch.cuda.synchronize(target.device)
        if target.is_cuda:
            torch.cuda.synchronize(target.device)
        tflops.append(flops * count / max(clock() - start, 1e-9) / 1e12)
        samples.append(sampler.sample())
    return BurnOutcome(interval_tflops=tuple(tflops), samples=tuple(samples))


def measurements(outcome: BurnOutcome) -> list[measurement.Measurement]:
    out = [
        measurement.Measurement(test="burn.tflops", value=outcome.median_tflops, unit="TFLOP/s"),
        measurement.Measurement(
            test="burn.stability", value=outcome.throughput_stability, unit="min/median"
        ),
        measurement.Measurement(
            test="burn.throttle_faults",
            value=float(outcome.fault_samples),
            unit="samples",
            kind=measurement.Kind.ERRORS,
            note=", ".join(sorted(set().union(*(s.reasons for s in outcome.samples)))),
        ),
    ]
    clocks = [s.sm_mhz for s in outcome.samples if s.sm_mhz is not None]
    if clocks:
        out.append(measurement.Measurement(test="clock.sm_min", value=min(clocks), unit="MHz"))
    temps = [s.temperature_c for s in outcome.samples if s.temperature_c is not None]
    if temps:
        out.append(
            measurement.Measurement(
                test="thermal.max", value=max(temps), unit="C", higher_is_better=False
            )
        )
    return out
