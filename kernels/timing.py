"""Timing of diagnostic kernels: CUDA events on GPUs, a monotonic clock on CPUs.

Pure measurement helpers; they launch nothing of their own and never touch the collector,
the CLI or torch.distributed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Per-iteration seconds of one measured callable."""

    samples_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples_s:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def best_s(self) -> float:
        return min(self.samples_s)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable[[], object],
    *,
    device: torch.device,
    warmup: int = 3,
    iters: int = 10,
) -> Timing:
    """Run `fn` `warmup` times untimed, then time `iters` runs one by one.

    On CUDA each run sits between two events on the current stream, so host overhead between
    launches does not count; on CPU each run is timed with `time.perf_counter`.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        return _measure_cuda(fn, device=device, iters=iters)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing(samples_s=tuple(samples))


def _measure_cuda(fn: Callable[[], object], *, device: torch.device, iters: int) -> Timing:
    with torch.cuda.device(device):
        starts = [_event() for _ in range(iters)]
        ends = [_event() for _ in range(iters)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
    return Timing(
        samples_s=tuple(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True))
    )


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
