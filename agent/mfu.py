"""Model FLOPs utilisation: FLOPs per token and the device's peak FLOP/s.

- FLOPs per token from the model shape, PaLM appendix B: 6N + 12·L·H·Q·T, by the one definition
  in `vigil.flops` (N excludes the input embedding table, includes the output head), or measured
  once with `torch.utils.flop_counter.FlopCounterMode`.
- Peak from a table of dense bf16 tensor-core peaks of common accelerators, or a measured CPU GEMM
  peak (fp32) when running on CPU.

No I/O; `measure_cpu_peak` and `count_flops` run torch compute and are called at most once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from vigil import flops

log = logging.getLogger(__name__)

# Dense (no sparsity) bf16 peak FLOP/s from the vendors' data sheets. Matched by substring of the
# device name, longest key first, so "H100 PCIe" wins over "H100".
PEAK_BF16_FLOPS: dict[str, float] = {
    "A100": 312e12,
    "A10G": 70e12,
    "L4": 121e12,
    "L40S": 362e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H800": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "GB200": 2500e12,
    "MI250X": 383e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
    "MI355X": 2500e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
}


# The model-shape estimate lives in the core, shared with the bundled trainer's recipes.
palm_flops_per_token = flops.flops_per_token


def peak_for_device(name: str) -> float | None:
    """The table's dense bf16 peak for a device name such as 'NVIDIA H100 80GB HBM3'."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return PEAK_BF16_FLOPS[key]
    return None


_cpu_peak: float | None = None


def measure_cpu_peak(*, size: int = 512, budget_s: float = 0.2) -> float:
    """Best fp32 GEMM FLOP/s this process reaches on CPU within `budget_s` (cached)."""
    global _cpu_peak
    if _cpu_peak is not None:
        return _cpu_peak
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool, allocation
    best = 0.0
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        if elapsed > 0:
            best = max(best, 2.0 * size**3 / elapsed)
    _cpu_peak = best
    return best


def device_peak(*, measure_cpu: bool) -> tuple[str, float]:
    """(device kind, peak FLOP/s) of this process's device; peak 0 when unknown."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.cuda.current_device())
        peak = peak_for_device(name)
        if peak is None:
            log.warning("no peak FLOP/s known for %r: pass peak_flops= to get MFU", name)
        return name, peak or 0.0
    if measure_cpu:
        return "cpu", measure_cpu_peak()
    return "cpu", 0.0


def count_flops(run: Callable[[], Any]) -> float:
    """FLOPs `run()` performs (forward + backward if it runs both), by torch's flop counter."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        run()
    return float(counter.get_total_flops())


def mfu(*, flops_per_token: float, tokens: int, seconds: float, peak_flops: float) -> float:
    """Achieved model FLOP/s over peak; 0 when any input is unknown."""
    if seconds <= 0 or peak_flops <= 0 or flops_per_token <= 0 or tokens <= 0:
        return 0.0
    return flops_per_token * tokens / seconds / peak_flops
