"""The Triton matmul behind the GEMM-throughput and SDC diagnostics (imports Triton at load).

A tiled, grouped-ordering matmul with fp32 accumulation for fp32/fp16/bf16/fp8 inputs,
autotuned over tile shapes that suit Hopper (sm_90) tensor cores, with a fixed small tile for
Triton's CPU interpreter. An optional planted fault flips bits of one output element, so tests
and demos can show that a device computing wrong without crashing is caught. Only
`vigil.kernels.gemm` and `vigil.kernels.sdc` import this module; it does no timing or I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Flip `mask` bits of the fp32 accumulator of output element `index` (row-major)."""

    index: int
    mask: int = 1 << 20

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"fault index must be >= 0, got {self.index}")
        if not 0 < self.mask < 2**31:
            raise ValueError(f"fault mask must be a non-zero 31-bit mask, got {self.mask:#x}")


def _config(bm: int, bn: int, bk: int, stages: int, warps: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
        num_stages=stages,
        num_warps=warps,
    )


# Tile shapes for Hopper wgmma: 128x256 and 256x128 tiles with 3-4 pipeline stages are where
# large bf16/fp16 GEMMs reach cuBLAS-like throughput; BLOCK_K=128 suits fp8's 32-byte k-steps.
# Few configs on purpose: each costs a compile (seconds) the first time a shape is seen.
HOPPER_CONFIGS = [
    _config(128, 256, 64, 3, 8),
    _config(256, 128, 64, 3, 8),
    _config(128, 256, 64, 4, 8),
    _config(128, 128, 64, 4, 4),
    _config(128, 128, 128, 4, 8),
]
# One fixed Hopper-friendly tile for correctness work (SDC, agreement tests): no autotuning,
# so one compile, and the same kernel on every device of a fleet.
FIXED_META = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
# The interpreter runs on NumPy: small tiles keep the per-program work cheap.
INTERPRETER_META = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}


@triton.jit
def _tile_indices(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-tiles share column tiles of B while they sit in L2.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m, pid_n


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    fault_index,
    fault_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    INJECT_FAULT: tl.constexpr,
):
    pid_m, pid_n = _tile_indices(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/columns past the edge wrap around: loads stay in bounds without masks in the
    # inner loop, and the store below drops them. Triton's axis analysis keeps the runs
    # contiguous (and loads vectorized) when M and N are divisible by 16, so no hints are needed
    # (a multiple_of/max_contiguous hint would be false on a ragged edge tile).
    rows_a = offs_m % M
    cols_b = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE_FP32:  # noqa: SIM108 (Triton specializes on the constexpr branch)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if INJECT_FAULT:
        flat = offs_m[:, None] * N + offs_n[None, :]
        flipped = (acc.to(tl.int32, bitcast=True) ^ fault_mask).to(tl.float32, bitcast=True)
        acc = tl.where(flat == fault_index, flipped, acc)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


_autotuned: Any = None


def _autotuned_kernel() -> Any:
    global _autotuned
    if _autotuned is None:
        _autotuned = triton.autotune(configs=HOPPER_CONFIGS, key=["M", "N", "K"])(matmul_kernel)
    return _autotuned


def default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp8 products are returned in bf16, as torch._scaled_mm does.
    return torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    fault: Fault | None = None,
    meta: dict[str, int] | None = None,
) -> torch.Tensor:
    """C = A @ B with Triton; autotuned on CUDA, `meta` (or a small tile) otherwise."""
    check_operands(a, b)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=out_dtype or default_out_dtype(a.dtype))
    if M == 0 or N == 0:
        return c
    grid: Callable[[dict[str, Any]], tuple[int]] = lambda m: (  # noqa: E731
        triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),
    )
    args = (a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride())
    flags = {
        "IEEE_FP32": a.dtype == torch.float32,
        "INJECT_FAULT": fault is not None,
    }
    fault_args = (fault.index, fault.mask) if fault else (-1, 0)
    if a.is_cuda and meta is None:
        _autotuned_kernel()[grid](*args, *fault_args, **flags)
    else:
        matmul_kernel[grid](*args, *fault_args, **(meta or INTERPRETER_META), **flags)
    return c


def check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"need 2-D operands (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}"
        )
    if a.dtype != b.dtype or a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"operands must share one of {[str(d) for d in SUPPORTED_DTYPES]}, "
            f"got {a.dtype} and {b.dtype}"
        )
    if a.device != b.device:
        raise ValueError(f"operands are on different devices: {a.device} and {b.device}")
