"""GEMM throughput: vigil's Triton matmul beside torch.matmul (cuBLAS), with agreement checks.

For each dtype the diagnostic times both implementations on the same operands, reports TFLOP/s
and the largest difference between them relative to the product's scale. fp8 runs on devices
with fp8 tensor cores (sm_89+) against `torch._scaled_mm`. Without CUDA the torch path runs on
CPU (and the Triton one too when TRITON_INTERPRET=1). No NVML, I/O or collector access here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vigil.kernels import devices, measurement, timing

log = logging.getLogger(__name__)

# Relative agreement (max |triton - torch| / max |torch|) two correct kernels reach: both
# accumulate in fp32, so they differ by output rounding and summation order only.
AGREEMENT_TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
    torch.float8_e4m3fn: 3e-2,
}
DTYPE_NAMES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    size: int = 8192
    dtypes: tuple[str, ...] = ("bf16",)
    warmup: int = 3
    iters: int = 10
    # Also time the Triton kernel on a CPU under TRITON_INTERPRET=1 (very slow: tiny sizes only).
    interpret_on_cpu: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"GEMM size must be >= 1, got {self.size}")
        unknown = [d for d in self.dtypes if d not in DTYPE_NAMES]
        if unknown or not self.dtypes:
            raise ValueError(
                f"GEMM dtypes must be some of {sorted(DTYPE_NAMES)}, got {self.dtypes}"
            )
        if self.warmup < 0 or self.iters < 1:
            raise ValueError("GEMM needs warmup >= 0 and iters >= 1")


@dataclass(frozen=True, kw_only=True)
class GemmFigures:
    dtype: str
    size: int
    torch_tflops: float
    triton_tflops: float | None
    rel_error: float | None
    tolerance: float
    triton_variant: str = ""  # the fastest Triton kernel: pointer, tma or tma-persistent

    @property
    def ratio_to_torch(self) -> float | None:
        if self.triton_tflops is None or self.torch_tflops <= 0:
            return None
        return self.triton_tflops / self.torch_tflops

    @property
    def agrees(self) -> bool:
        return self.rel_error is None or self.rel_error <= self.tolerance


def runnable_dtypes(target: devices.Target, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The wanted dtypes this device can multiply (fp8 needs sm_89+, bf16 a GPU or fp32 CPU)."""
    keep = []
    for name in wanted:
        if name == "fp8" and not target.supports_fp8_dot:
            log.info("skipping fp8 GEMM on %s: no fp8 tensor cores", target.name)
            continue
        keep.append(name)
    return tuple(keep)


def operands(
    size: int, dtype: torch.dtype, device: torch.device, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-scale random A (M, K) and B (K, N); fp8's B is column-major, as cuBLAS wants it."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(size, size, generator=gen).to(device)
    b = torch.randn(size, size, generator=gen).to(device)
    if dtype == torch.float8_e4m3fn:
        return a.to(dtype), b.t().contiguous().to(dtype).t()
    return a.to(dtype), b.to(dtype)


def torch_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference: cuBLAS through torch (scaled_mm for fp8), full fp32 for fp32 inputs."""
    if a.dtype == torch.float8_e4m3fn:
        one = torch.ones((), device=a.device, dtype=torch.float32)
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return torch.matmul(a, b)


def relative_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    ref = reference.float()
    scale = ref.abs().max().item() or 1.0
    return float((candidate.float() - ref).abs().max().item() / scale)


def run(target: devices.Target, config: GemmConfig) -> list[GemmFigures]:
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means IEEE fp32 on both sides
    try:
        return [_run_dtype(target, config, name) for name in runnable_dtypes(target, config.dtypes)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32


def _run_dtype(target: devices.Target, config: GemmConfig, name: str) -> GemmFigures:
    dtype = DTYPE_NAMES[name]
    a, b = operands(config.size, dtype, target.device)
    flops = 2.0 * config.size**3
    ref = torch_matmul(a, b)
    torch_t = timing.measure(
        lambda: torch_matmul(a, b), device=target.device, warmup=config.warmup, iters=config.iters
    )
    triton_tflops: float | None = None
    rel_error: float | None = None
    variant = ""
    if _use_triton(target, config):
        for name_, kernel in _triton_variants(target).items():
            err = relative_error(kernel(a, b), ref)
            seconds = _seconds(kernel, a, b, target, config)
            tflops = flops / seconds / 1e12
            log.info("GEMM %s %s: %.1f TFLOP/s, relative error %.1e", name, name_, tflops, err)
            # Every variant must agree with the reference; the fastest one is reported.
            rel_error = err if rel_error is None else max(rel_error, err)
            if triton_tflops is None or tflops > triton_tflops:
                triton_tflops, variant = tflops, name_
    return GemmFigures(
        dtype=name,
        size=config.size,
        torch_tflops=flops / torch_t.median_s / 1e12,
        triton_tflops=triton_tflops,
        rel_error=rel_error,
        tolerance=AGREEMENT_TOLERANCE[dtype],
        triton_variant=variant,
    )


def _seconds(
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    target: devices.Target,
    config: GemmConfig,
) -> float:
    run = timing.measure(
        lambda: kernel(a, b), device=target.device, warmup=config.warmup, iters=config.iters
    )
    return run.median_s


def _triton_variants(
    target: devices.Target,
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """vigil's Triton matmuls this device runs: pointer tiles everywhere, TMA (tiled and
    persistent) from sm_90 on."""
    from vigil.kernels import triton_gemm

    variants: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "pointer": lambda a, b: triton_gemm.matmul(a, b)
    }
    if target.capability >= (9, 0) or not target.is_cuda:
        from vigil.kernels import triton_gemm_tma

        variants["tma"] = lambda a, b: triton_gemm_tma.matmul(a, b)
        variants["tma-persistent"] = lambda a, b: triton_gemm_tma.matmul(a, b, persistent=True)
    return variants


def _use_triton(target: devices.Target, config: GemmConfig) -> bool:
    if devices.backend_for(target) is not devices.Backend.TRITON:
        return False
    return target.is_cuda or config.interpret_on_cpu


def measurements(figures: list[GemmFigures]) -> list[measurement.Measurement]:
    out = []
    for f in figures:
        spec_key = f"gemm.{f.dtype}"
        out.append(
            measurement.Measurement(
                test=f"gemm.{f.dtype}.torch",
                value=f.torch_tflops,
                unit="TFLOP/s",
                spec_key=spec_key,
            )
        )
        if f.triton_tflops is None:
            continue
        out.append(
            measurement.Measurement(
                test=f"gemm.{f.dtype}.triton",
                value=f.triton_tflops,
                unit="TFLOP/s",
                spec_key=spec_key,
            )
        )
        out.append(
            measurement.Measurement(
                test=f"gemm.{f.dtype}.disagreements",
                value=0.0 if f.agrees else 1.0,
                unit="count",
                kind=measurement.Kind.ERRORS,
                note=f"relative error {f.rel_error:.2e} (tolerance {f.tolerance:.0e})",
            )
        )
    return out
