"""An integer mixing kernel for the SDC diagnostic: ALU work whose result is exact everywhere.

Each element starts from its index and the seed and goes through ROUNDS of multiply/xor-shift
mixing in uint32 (wrapping arithmetic, as C defines it), so every correct device produces the same
bits, and `reference` reproduces them in int64 torch ops. A planted fault xors one element's
result. Imports Triton at load; only `vigil.kernels.sdc` imports it. No timing or I/O here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MULTIPLIER = 0x9E3779B1  # 2**32 / golden ratio: odd, so multiplication is a bijection mod 2**32
MASK32 = 0xFFFFFFFF
INTERPRETER_BLOCK = 1024
CUDA_BLOCK = 1024


@triton.jit
def hash_kernel(
    out_ptr, n, seed, fault_index, fault_mask, ROUNDS: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = (offs.to(tl.uint32) ^ seed.to(tl.uint32)).to(tl.uint32)
    for r in range(ROUNDS):
        x = x * 0x9E3779B1 + r
        x = x ^ (x >> 15)
        x = x ^ (x << 7)
    x = tl.where(offs == fault_index, x ^ fault_mask.to(tl.uint32), x)
    tl.store(out_ptr + offs, x.to(tl.int32, bitcast=True), mask=offs < n)


def run(
    n: int,
    *,
    seed: int,
    rounds: int,
    device: torch.device,
    fault_index: int = -1,
    fault_mask: int = 0,
) -> torch.Tensor:
    """n mixed words as int32 (the uint32 bits), computed by Triton on `device`."""
    if n < 1 or rounds < 1:
        raise ValueError(f"hash kernel needs n >= 1 and rounds >= 1, got n={n}, rounds={rounds}")
    out = torch.empty(n, dtype=torch.int32, device=device)
    block = CUDA_BLOCK if out.is_cuda else INTERPRETER_BLOCK
    grid = (triton.cdiv(n, block),)
    hash_kernel[grid](out, n, seed & MASK32, fault_index, fault_mask, ROUNDS=rounds, BLOCK=block)
    return out


def reference(n: int, *, seed: int, rounds: int, device: torch.device) -> torch.Tensor:
    """The same mixing in int64 torch ops, masked to 32 bits after every step."""
    x = (torch.arange(n, dtype=torch.int64, device=device) & MASK32) ^ (seed & MASK32)
    for r in range(rounds):
        x = (x * MULTIPLIER + r) & MASK32
        x = x ^ (x >> 15)
        x = (x ^ (x << 7)) & MASK32
    return (x - ((x >> 31) << 32)).to(torch.int32)
