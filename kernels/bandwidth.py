"""Memory bandwidth: STREAM copy/scale/add/triad (Triton beside torch) and host<->device copies.

Device-memory figures compare vigil's Triton kernels with the same operation done by torch
(a device-to-device `copy_` for copy). Host<->device figures time pinned-memory copies on CUDA;
on a CPU-only node they time a host-to-host copy instead and say so. Bytes follow STREAM's
convention (every array read or written counts once). No NVML, I/O or collector access.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vigil.kernels import devices, measurement, timing

log = logging.getLogger(__name__)

STREAM_OPS = ("copy", "scale", "add", "triad")
ARRAYS_TOUCHED = {"copy": 2, "scale": 2, "add": 3, "triad": 3}
SCALAR = 3.0


@dataclass(frozen=True, kw_only=True)
class BandwidthConfig:
    # 1 GiB per fp32 array on a GPU: far past any L2, so this is HBM bandwidth.
    stream_bytes: int = 1 << 30
    ops: tuple[str, ...] = STREAM_OPS
    # 1 GiB host buffer: large enough that per-copy driver overhead is negligible.
    host_bytes: int = 1 << 30
    warmup: int = 2
    iters: int = 10
    interpret_on_cpu: bool = False

    def __post_init__(self) -> None:
        if self.stream_bytes < 4 or self.host_bytes < 4:
            raise ValueError("bandwidth buffers must hold at least one fp32 element")
        bad = [op for op in self.ops if op not in STREAM_OPS]
        if bad:
            raise ValueError(f"stream ops must be some of {STREAM_OPS}, got {bad}")
        if self.warmup < 0 or self.iters < 1:
            raise ValueError("bandwidth needs warmup >= 0 and iters >= 1")


@dataclass(frozen=True, kw_only=True)
class StreamFigures:
    op: str
    torch_gb_s: float
    triton_gb_s: float | None
    wrong_elements: int

    @property
    def ratio_to_torch(self) -> float | None:
        return None if self.triton_gb_s is None else self.triton_gb_s / self.torch_gb_s


def torch_stream(op: str, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """The reference for each STREAM op, done by torch's own kernels."""
    if op == "copy":
        out.copy_(x)
    elif op == "scale":
        torch.mul(x, SCALAR, out=out)
    elif op == "add":
        torch.add(x, y, out=out)
    elif op == "triad":
        torch.add(x, y, alpha=SCALAR, out=out)
    else:
        raise ValueError(f"stream op must be one of {STREAM_OPS}, got {op!r}")


def run_stream(target: devices.Target, config: BandwidthConfig) -> list[StreamFigures]:
    n = config.stream_bytes // 4
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.rand(n, generator=gen).to(target.device)
    y = torch.rand(n, generator=gen).to(target.device)
    out = torch.empty_like(x)
    expected = torch.empty_like(x)
    use_triton = devices.backend_for(target) is devices.Backend.TRITON and (
        target.is_cuda or config.interpret_on_cpu
    )
    figures = []
    for op in config.ops:
        moved = ARRAYS_TOUCHED[op] * n * 4

        def reference(op: str = op) -> None:
            torch_stream(op, expected, x, y)

        torch_gb_s = moved / _time(reference, target, config) / 1e9
        triton_gb_s, wrong = None, 0
        if use_triton:
            from vigil.kernels import triton_stream

            def kernel(op: str = op) -> None:
                triton_stream.run(op, out, x, y, SCALAR)

            kernel()
            wrong = int((~torch.isclose(out, expected, rtol=1e-6, atol=0.0)).sum().item())
            triton_gb_s = moved / _time(kernel, target, config) / 1e9
        figures.append(
            StreamFigures(
                op=op, torch_gb_s=torch_gb_s, triton_gb_s=triton_gb_s, wrong_elements=wrong
            )
        )
    return figures


def _time(fn: Callable[[], object], target: devices.Target, config: BandwidthConfig) -> float:
    return timing.measure(
        fn, device=target.device, warmup=config.warmup, iters=config.iters
    ).median_s


@dataclass(frozen=True, kw_only=True)
class HostFigures:
    h2d_gb_s: float
    d2h_gb_s: float
    # True on CPU-only nodes, where both figures are host-to-host copies.
    host_only: bool


def run_host(target: devices.Target, config: BandwidthConfig) -> HostFigures:
    n = config.host_bytes // 4
    if not target.is_cuda:
        src, dst = torch.rand(n), torch.empty(n)
        seconds = _time(lambda: dst.copy_(src), target, config)
        rate = config.host_bytes / seconds / 1e9
        return HostFigures(h2d_gb_s=rate, d2h_gb_s=rate, host_only=True)
    host = torch.rand(n).pin_memory()
    dev = torch.empty(n, device=target.device)
    h2d = _time(lambda: dev.copy_(host, non_blocking=True), target, config)
    d2h = _time(lambda: host.copy_(dev, non_blocking=True), target, config)
    return HostFigures(
        h2d_gb_s=config.host_bytes / h2d / 1e9,
        d2h_gb_s=config.host_bytes / d2h / 1e9,
        host_only=False,
    )


def measurements(
    stream: list[StreamFigures], host: HostFigures | None
) -> list[measurement.Measurement]:
    out = []
    for f in stream:
        out.append(_gb_s(f"stream.{f.op}.torch", f.torch_gb_s, "hbm"))
        if f.triton_gb_s is not None:
            out.append(_gb_s(f"stream.{f.op}.triton", f.triton_gb_s, "hbm"))
            out.append(
                measurement.Measurement(
                    test=f"stream.{f.op}.wrong_elements",
                    value=float(f.wrong_elements),
                    unit="count",
                    kind=measurement.Kind.ERRORS,
                )
            )
    if host is not None:
        note = "host-to-host copy (no GPU)" if host.host_only else "pinned host memory"
        out.append(_gb_s("pcie.h2d", host.h2d_gb_s, "" if host.host_only else "pcie", note))
        out.append(_gb_s("pcie.d2h", host.d2h_gb_s, "" if host.host_only else "pcie", note))
    return out


def _gb_s(test: str, value: float, spec_key: str, note: str = "") -> measurement.Measurement:
    return measurement.Measurement(
        test=test, value=value, unit="GB/s", spec_key=spec_key, note=note
    )
