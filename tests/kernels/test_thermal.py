"""Clock/thermal burn: NVML readings decoded, throttling faults counted, a real CPU burn."""

# ruff: noqa: N802 (FakeNvml mirrors pynvml's camelCase API)

from __future__ import annotations

from vigil.kernels import devices, thermal


class FakeNvml:
    """Stands in for the pynvml module on a machine without NVIDIA's driver (this one)."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, reasons: int) -> None:
        self.reasons = reasons
        self.uuid: str | None = None

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.uuid = uuid
        return "handle"

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        return 1755

    def nvmlDeviceGetMaxClockInfo(self, handle: str, clock: int) -> int:
        return 1980

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        return 71

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 690_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        return self.reasons


def test_nvml_sampler_reads_clocks_and_decodes_throttle_reasons() -> None:
    nvml = FakeNvml(reasons=0x4 | 0x40)
    sample = thermal.NvmlSampler("GPU-abc", nvml=nvml).sample()
    assert nvml.uuid == "GPU-abc"
    assert (sample.sm_mhz, sample.max_sm_mhz, sample.temperature_c, sample.power_w) == (
        1755.0,
        1980.0,
        71.0,
        690.0,
    )
    assert sample.reasons == {"sw_power_cap", "hw_thermal_slowdown"}


def test_power_capping_is_normal_but_thermal_slowdown_is_a_fault() -> None:
    capped = thermal.ClockSample(reasons=thermal.decode_reasons(0x4))
    hot = thermal.ClockSample(reasons=thermal.decode_reasons(0x4 | 0x20))
    outcome = thermal.BurnOutcome(interval_tflops=(700.0, 690.0, 560.0), samples=(capped, hot, hot))
    assert outcome.fault_samples == 2
    assert outcome.throughput_stability == 560.0 / 690.0
    found = {m.test: m for m in thermal.measurements(outcome)}
    assert found["burn.throttle_faults"].value == 2
    assert "sw_thermal_slowdown" in found["burn.throttle_faults"].note


def test_a_cpu_burn_reports_steady_sane_throughput() -> None:
    samples: list[thermal.ClockSample] = []

    class CountingSampler:
        def sample(self) -> thermal.ClockSample:
            samples.append(thermal.ClockSample(sm_mhz=3000.0, temperature_c=55.0))
            return samples[-1]

    config = thermal.BurnConfig(duration_s=0.6, interval_s=0.2, size=128, dtype="fp32")
    outcome = thermal.burn(devices.cpu_target(), config, CountingSampler())
    assert len(outcome.interval_tflops) == len(samples) >= 2
    assert 1e-5 < outcome.median_tflops < 50  # a CPU core does GFLOP/s, not PFLOP/s
    found = {m.test: m.value for m in thermal.measurements(outcome)}
    assert found["clock.sm_min"] == 3000.0 and found["thermal.max"] == 55.0
    assert isinstance(thermal.sampler_for(devices.cpu_target()), thermal.HostSampler)
