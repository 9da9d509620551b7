"""STREAM-style Triton kernels (copy, scale, add, triad) for the memory-bandwidth diagnostic.

One kernel, the operation chosen at compile time, over flat contiguous tensors with 64-bit
offsets (arrays may exceed 2**31 elements on a 141 GB device). Autotuned block sizes on CUDA; a
fixed block under Triton's CPU interpreter. Imports Triton at load; only
`vigil.kernels.bandwidth` imports it. No timing or I/O here.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

# Operation codes, also the number of arrays each one touches (reads + writes) per element.
OPS = {"copy": 0, "scale": 1, "add": 2, "triad": 3}
ARRAYS_TOUCHED = {"copy": 2, "scale": 2, "add": 3, "triad": 3}
INTERPRETER_BLOCK = 1024

# Large blocks with 8 warps keep enough bytes in flight to saturate HBM3e on Hopper.
CUDA_CONFIGS = [
    triton.Config({"BLOCK": block}, num_warps=warps)
    for block, warps in ((2048, 4), (4096, 8), (8192, 8), (16384, 16))
]


@triton.jit
def stream_kernel(x_ptr, y_ptr, out_ptr, n, scalar, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, eviction_policy="evict_first")
    if OP == 0:
        out = x
    elif OP == 1:
        out = x * scalar
    elif OP == 2:
        out = x + tl.load(y_ptr + offs, mask=mask, eviction_policy="evict_first")
    else:
        out = x + scalar * tl.load(y_ptr + offs, mask=mask, eviction_policy="evict_first")
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


_autotuned: Any = None


def _kernel() -> Any:
    global _autotuned
    if _autotuned is None:
        _autotuned = triton.autotune(configs=CUDA_CONFIGS, key=["n", "OP"])(stream_kernel)
    return _autotuned


def run(op: str, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None, scalar: float) -> None:
    """out = x | s*x | x+y | x+s*y for op copy | scale | add | triad."""
    if op not in OPS:
        raise ValueError(f"stream op must be one of {sorted(OPS)}, got {op!r}")
    if ARRAYS_TOUCHED[op] == 3 and y is None:
        raise ValueError(f"stream op {op!r} needs a second input")
    tensors = [t for t in (out, x, y) if t is not None]
    if any(not t.is_contiguous() or t.shape != out.shape for t in tensors):
        raise ValueError("stream kernels take contiguous tensors of one shape")
    n = out.numel()
    second = y if y is not None else x
    if out.is_cuda:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
        _kernel()[grid](x, second, out, n, scalar, OP=OPS[op])
    else:
        grid_cpu = (triton.cdiv(n, INTERPRETER_BLOCK),)
        stream_kernel[grid_cpu](x, second, out, n, scalar, OP=OPS[op], BLOCK=INTERPRETER_BLOCK)
