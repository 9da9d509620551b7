"""Silent data corruption: compute-heavy work whose exact result every correct device agrees on.

Two workloads, both exact so checksums can be compared bit for bit:
  - a chain of tensor-core GEMMs on small-integer operands (|a|, |b| <= 4) in fp16/bf16 with fp32
    accumulation: every product and partial sum is an integer below 2**24, so the result is
    exact whatever the summation order; each round's result (mod 9, minus 4) feeds the next;
  - an integer multiply/xor-shift mixing kernel (ALU work).
The reference recomputes the GEMM chain in fp64 (on the CPU for CPU targets, with the device's
fp64 units otherwise, which are not the units under test) and the mixing in int64 torch ops.
A device whose checksum differs from the reference, or from the other devices of its node or the
fleet, is flagged. A planted `Fault` makes one device wrong on purpose (tests, demos).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vigil.kernels import devices, measurement

log = logging.getLogger(__name__)

CHECKSUM_BITS = 52  # a checksum fits a float64 DiagResult.value exactly
_CHECKSUM_MASK = (1 << CHECKSUM_BITS) - 1
_WEIGHT = 2654435761  # odd 32-bit multiplier: position-weighted, so swapped values change the sum
OPERAND_RANGE = 4  # operands in [-4, 4]: |sum| <= 16 K, exact in fp32 for K < 2**20


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Make the device under test wrong: flip `mask` bits of one element in one round."""

    round: int = 0
    index: int = 0
    mask: int = 1 << 3

    def __post_init__(self) -> None:
        if self.round < 0 or self.index < 0 or not 0 < self.mask < 2**31:
            raise ValueError(f"fault needs round >= 0, index >= 0, 0 < mask < 2**31, got {self}")


@dataclass(frozen=True, kw_only=True)
class SdcConfig:
    size: int = 4096
    rounds: int = 8
    dtype: str = "bf16"  # the GEMM operand type on GPUs; CPUs use fp32
    hash_elements: int = 1 << 24
    hash_rounds: int = 64
    seed: int = 20240601
    fault: Fault | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.size < 1 << 20:
            raise ValueError(f"SDC GEMM size must be in [1, 2**20) to stay exact, got {self.size}")
        if self.rounds < 1 or self.hash_rounds < 1 or self.hash_elements < 1:
            raise ValueError("SDC needs rounds, hash_rounds and hash_elements >= 1")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"SDC dtype must be fp32, fp16 or bf16, got {self.dtype!r}")


@dataclass(frozen=True, kw_only=True)
class SdcOutcome:
    checksum: int
    expected: int
    mismatched_rounds: tuple[int, ...]
    hash_mismatches: int

    @property
    def mismatches(self) -> int:
        return len(self.mismatched_rounds) + self.hash_mismatches


def checksum(values: torch.Tensor) -> int:
    """Position-weighted sum of the fp32 bit patterns, wrapping in int64, kept to 52 bits.

    Bits, not values: a flipped low mantissa bit changes the checksum even where it would round
    away. Integer-valued results below 2**24 are exact in fp32, so fp64 references convert
    losslessly; adding +0.0 turns a -0.0 into +0.0 so the sign of a zero never counts.
    """
    flat = (values.reshape(-1).to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)
    weights = (torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * _WEIGHT + 1) & (
        (1 << 32) - 1
    )
    return int((flat * weights).sum().item()) & _CHECKSUM_MASK


def fold(checksums: list[int]) -> int:
    total = 0
    for value in checksums:
        total = (total * 1_000_003 + value) & _CHECKSUM_MASK
    return total


def initial_operands(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (size, size)
    a = torch.randint(-OPERAND_RANGE, OPERAND_RANGE + 1, shape, generator=gen)
    b = torch.randint(-OPERAND_RANGE, OPERAND_RANGE + 1, shape, generator=gen)
    return a, b


def next_operand(c: torch.Tensor) -> torch.Tensor:
    """Fold a round's exact integer result back into [-4, 4] for the next round."""
    return torch.remainder(c, 2 * OPERAND_RANGE + 1) - OPERAND_RANGE


def gemm_chain(target: devices.Target, config: SdcConfig, *, reference: bool) -> list[int]:
    """Per-round checksums of the GEMM chain: the device under test, or the fp64 reference."""
    a0, b0 = initial_operands(config.size, config.seed)
    ref_device = target.device if target.is_cuda else torch.device("cpu")
    dtype = _operand_dtype(target, config) if not reference else torch.float64
    a = a0.to(ref_device if reference else target.device, dtype)
    b = b0.to(a.device, dtype)
    sums = []
    for round_ in range(config.rounds):
        c = torch.matmul(a, b) if reference else _device_matmul(a, b, target, config, round_)
        sums.append(checksum(c))
        a = next_operand(c).to(dtype)
    return sums


def _operand_dtype(target: devices.Target, config: SdcConfig) -> torch.dtype:
    if not target.is_cuda:
        return torch.float32
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[config.dtype]


def _device_matmul(
    a: torch.Tensor, b: torch.Tensor, target: devices.Target, config: SdcConfig, round_: int
) -> torch.Tensor:
    fault = config.fault if config.fault and config.fault.round == round_ else None
    if devices.backend_for(target) is devices.Backend.TRITON:
        from vigil.kernels import triton_gemm

        kernel_fault = triton_gemm.Fault(index=fault.index, mask=fault.mask) if fault else None
        meta = triton_gemm.FIXED_META if a.is_cuda else None
        return triton_gemm.matmul(a, b, out_dtype=torch.float32, fault=kernel_fault, meta=meta)
    # fp32 math (CUDA cores, or TF32 tensor cores: exact too for operands in [-4, 4]).
    c = torch.matmul(a.float(), b.float())
    if fault is not None:  # the torch path has no kernel to plant it in: corrupt the result
        flat = c.view(-1).view(torch.int32)
        flat[fault.index] ^= fault.mask
    return c


def hash_mismatches(target: devices.Target, config: SdcConfig) -> int:
    """Elements of the integer mixing kernel differing from the int64 reference (0: no Triton)."""
    if devices.backend_for(target) is not devices.Backend.TRITON:
        return 0
    from vigil.kernels import triton_hash

    fault = config.fault
    got = triton_hash.run(
        config.hash_elements,
        seed=config.seed,
        rounds=config.hash_rounds,
        device=target.device,
        fault_index=fault.index if fault else -1,
        fault_mask=fault.mask if fault else 0,
    )
    want = triton_hash.reference(
        config.hash_elements, seed=config.seed, rounds=config.hash_rounds, device=target.device
    )
    return int((got != want).sum().item())


def run(target: devices.Target, config: SdcConfig) -> SdcOutcome:
    got = gemm_chain(target, config, reference=False)
    want = gemm_chain(target, config, reference=True)
    mismatched = tuple(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
    if mismatched:
        log.warning(
            "SDC: %s differs from the exact reference in rounds %s", target.device_id, mismatched
        )
    return SdcOutcome(
        checksum=fold(got),
        expected=fold(want),
        mismatched_rounds=mismatched,
        hash_mismatches=hash_mismatches(target, config),
    )


def outliers(checksums: Mapping[str, int]) -> list[str]:
    """Devices (or ranks) whose checksum differs from the most common one; all when no majority."""
    if len(checksums) < 2:
        return []
    counts = collections.Counter(checksums.values())
    (top, top_count), *rest = counts.most_common()
    if rest and rest[0][1] == top_count:
        return sorted(checksums)  # a tie: nobody can be trusted over anybody else
    return sorted(k for k, v in checksums.items() if v != top)


def measurements(
    outcome: SdcOutcome, *, peers_disagree: bool = False
) -> list[measurement.Measurement]:
    return [
        measurement.Measurement(
            test="sdc.mismatches",
            value=float(outcome.mismatches + (1 if peers_disagree else 0)),
            unit="count",
            kind=measurement.Kind.ERRORS,
            note=f"GEMM rounds wrong: {list(outcome.mismatched_rounds)}, "
            f"mixing elements wrong: {outcome.hash_mismatches}",
        ),
        measurement.Measurement(
            test="sdc.checksum",
            value=float(outcome.checksum),
            unit="checksum",
            kind=measurement.Kind.CHECKSUM,
            expected=float(outcome.expected),
        ),
    ]
