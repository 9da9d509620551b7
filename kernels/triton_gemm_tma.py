"""A TMA (tensor-memory-accelerator) variant of vigil's Triton matmul, for Hopper and later.

Operands travel through host-built tensor descriptors, so tiles are loaded by TMA with
out-of-bounds padding instead of pointer arithmetic and masks; this is how Triton GEMMs close the
gap to cuBLAS on sm_90. Throughput only: fault planting stays in `triton_gemm` (the SDC check).
A column-major B (fp8, as cuBLAS wants it) is read through a descriptor of B^T. Imports Triton
at load; only `vigil.kernels.gemm` imports it. Also runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vigil.kernels import triton_gemm


def _set_block_shapes(nargs: dict[str, Any]) -> None:
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_TRANSPOSED"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


HOPPER_CONFIGS = [
    triton.Config(
        c.kwargs, num_stages=c.num_stages, num_warps=c.num_warps, pre_hook=_set_block_shapes
    )
    for c in triton_gemm.HOPPER_CONFIGS
]


@triton.jit
def matmul_tma_kernel(
    a_desc,
    b_desc,
    c_desc,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_TRANSPOSED: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    pid_m, pid_n = triton_gemm._tile_indices(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        if B_TRANSPOSED:
            b = b_desc.load([off_n, k * BLOCK_K]).T
        else:
            b = b_desc.load([k * BLOCK_K, off_n])
        if IEEE_FP32:  # noqa: SIM108 (Triton specializes on the constexpr branch)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def matmul_tma_persistent_kernel(
    a_desc,
    b_desc,
    c_desc,
    M,
    N,
    K,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_TRANSPOSED: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    # One program per SM walks tiles NUM_SMS apart: no tail wave, and the next tile's loads
    # overlap this tile's epilogue.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = triton_gemm._tile_indices(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_tiles):
            a = a_desc.load([off_m, k * BLOCK_K])
            if B_TRANSPOSED:
                b = b_desc.load([off_n, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, off_n])
            if IEEE_FP32:  # noqa: SIM108 (Triton specializes on the constexpr branch)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


_autotuned: dict[str, Any] = {}


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    meta: dict[str, int] | None = None,
    persistent: bool = False,
) -> torch.Tensor:
    """C = A @ B through TMA descriptors; autotuned on CUDA, `meta` (or a small tile) otherwise.

    `persistent` launches one program per SM that loops over output tiles.
    """
    triton_gemm.check_operands(a, b)
    if a.stride(1) != 1:
        raise ValueError("the TMA matmul needs a row-major A")
    M, K = a.shape
    N = b.shape[1]
    dtype = out_dtype or triton_gemm.default_out_dtype(a.dtype)
    c = torch.empty((M, N), device=a.device, dtype=dtype)
    b_transposed = b.stride(0) == 1 and b.stride(1) != 1
    tile = meta or triton_gemm.INTERPRETER_META
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_source = b.t() if b_transposed else b
    b_desc = TensorDescriptor.from_tensor(b_source, [bn, bk] if b_transposed else [bk, bn])
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn])
    flags: dict[str, Any] = {"B_TRANSPOSED": b_transposed, "IEEE_FP32": a.dtype == torch.float32}
    kernel: Any = matmul_tma_kernel
    if persistent:
        kernel = matmul_tma_persistent_kernel
        flags["NUM_SMS"] = _num_sms(a.device)

    def grid(m: dict[str, Any]) -> tuple[int]:
        tiles = triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"])
        return (min(tiles, flags["NUM_SMS"]) if persistent else tiles,)

    if a.is_cuda and meta is None:
        name = "persistent" if persistent else "tiled"
        if name not in _autotuned:
            _autotuned[name] = triton.autotune(configs=HOPPER_CONFIGS, key=["M", "N", "K"])(kernel)
        _autotuned[name][grid](a_desc, b_desc, c_desc, M, N, K, **flags)
    else:
        kernel[grid](a_desc, b_desc, c_desc, M, N, K, **tile, **flags)
    return c


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4  # the interpreter: a few programs, so the tile loop is exercised
