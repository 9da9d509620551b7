"""Memory integrity: walking ones, moving inversions and address-in-address over device memory.

On CUDA hosts the kernels in csrc/memtest.cu (built at run time with torch.utils.cpp_extension)
run over most of the device's free memory, allocated as 1 GiB chunks; on CPUs the same passes
run with torch ops over a host buffer of the configured size (`vigil.kernels.memtest_engines`).
Each step goes over every chunk before the next starts, so a word has to hold its value while the
rest of memory is written. A planted `MemFault` makes one word lose a bit on every write (tests,
demos). Reports failing words, coverage of free memory and the effective bandwidth.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vigil.kernels import devices, measurement, memtest_engines
from vigil.kernels.memtest_engines import ADDRESS, ADDRESS_INVERTED, CONSTANT, NO_FAULT

log = logging.getLogger(__name__)

# Moving-inversion patterns: zeros/ones, then alternating bits (adjacent-bit coupling faults).
QUICK_PATTERNS = (0x00000000,)
FULL_PATTERNS = (0x00000000, 0xAAAAAAAA, 0xFFFFFFFF, 0x55555555)
QUICK_WALKING_BITS = (0, 7, 15, 31)
FULL_WALKING_BITS = tuple(range(32))
_MIN_CHUNK_BYTES = 1 << 20
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, kw_only=True)
class MemFault:
    """A stuck bit: word `index` (over all tested memory) gets `mask` xored in on every write."""

    index: int
    mask: int = 1 << 7

    def __post_init__(self) -> None:
        if self.index < 0 or not 0 < self.mask < 2**32:
            raise ValueError(f"memory fault needs index >= 0 and a 32-bit mask, got {self}")


@dataclass(frozen=True, kw_only=True)
class MemtestConfig:
    # 92 % of free memory: the rest stays for the CUDA context, the caching allocator's rounding
    # and the other processes a node runs (the issue asks for >= 90 % coverage).
    fraction_of_free: float = 0.92
    chunk_bytes: int = 1 << 30
    walking_bits: tuple[int, ...] = QUICK_WALKING_BITS
    patterns: tuple[int, ...] = QUICK_PATTERNS
    address: bool = True
    # Host memory tested on CPU-only nodes (all of it would take minutes and starve the node).
    cpu_bytes: int = 256 << 20
    fault: MemFault | None = None
    build_dir: Path | None = None

    def __post_init__(self) -> None:
        if not 0 < self.fraction_of_free <= 0.98:
            raise ValueError(f"fraction_of_free must be in (0, 0.98], got {self.fraction_of_free}")
        if self.chunk_bytes < 1 << 20 or self.chunk_bytes % 16:
            raise ValueError("chunk_bytes must be >= 1 MiB and a multiple of 16")
        if self.cpu_bytes < 16 or self.cpu_bytes % 16:
            raise ValueError("cpu_bytes must be a positive multiple of 16")
        if any(not 0 <= b < 32 for b in self.walking_bits):
            raise ValueError(f"walking bits must be in [0, 32), got {self.walking_bits}")
        if any(not 0 <= p < 2**32 for p in self.patterns):
            raise ValueError("moving-inversion patterns must be 32-bit")


@dataclass(frozen=True, kw_only=True)
class MemtestOutcome:
    tested_bytes: int
    free_bytes: int
    failing_words: int
    first_failing_word: int | None
    bytes_moved: int
    seconds: float
    passes: tuple[str, ...] = ()

    @property
    def coverage(self) -> float:
        return self.tested_bytes / self.free_bytes if self.free_bytes else 0.0

    @property
    def tb_per_s(self) -> float:
        return self.bytes_moved / self.seconds / 1e12 if self.seconds > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class Step:
    """One sweep over all chunks: fill, verify, or verify-then-write (moving inversions)."""

    op: str
    kind: int = CONSTANT
    pattern: int = 0
    write: int = 0
    descending: bool = False

    @property
    def bytes_per_word(self) -> int:
        return 8 if self.op == "verify_write" else 4

    def apply(self, engine: memtest_engines.Engine, chunk: int, fault: tuple[int, int]) -> None:
        if self.op == "fill":
            engine.fill(chunk, self.kind, self.pattern, fault)
        elif self.op == "verify":
            engine.verify(chunk, self.kind, self.pattern)
        else:
            engine.verify_write(chunk, self.pattern, self.write, self.descending, fault)


def plan(config: MemtestConfig) -> list[tuple[str, list[Step]]]:
    """The named passes of a run, in order."""
    passes: list[tuple[str, list[Step]]] = []
    if config.address:
        steps = []
        for kind in (ADDRESS, ADDRESS_INVERTED):
            steps += [Step(op="fill", kind=kind), Step(op="verify", kind=kind)]
        passes.append(("address-in-address", steps))
    for p in config.patterns:
        inverse = p ^ _MASK32
        steps = [
            Step(op="fill", pattern=p),
            Step(op="verify_write", pattern=p, write=inverse),
            Step(op="verify_write", pattern=inverse, write=p, descending=True),
            Step(op="verify", pattern=p),
        ]
        passes.append((f"moving-inversions {p:#010x}", steps))
    for bit in config.walking_bits:
        word = 1 << bit
        passes.append(
            (
                f"walking-ones bit {bit}",
                [Step(op="fill", pattern=word), Step(op="verify", pattern=word)],
            )
        )
    return passes


def run(target: devices.Target, config: MemtestConfig) -> MemtestOutcome:
    """Allocate most of free memory in chunks and run every pass of the plan over it."""
    if target.is_cuda:
        module = memtest_engines.build_cuda_module(config.build_dir)
        with torch.cuda.device(target.device):
            torch.cuda.empty_cache()
            free_bytes, _ = torch.cuda.mem_get_info(target.device)
            chunks = allocate(target.device, int(free_bytes * config.fraction_of_free), config)
            engine: memtest_engines.Engine = memtest_engines.CudaEngine(module, chunks)
            return _run_plan(target, engine, chunks, free_bytes, config)
    chunks = allocate(target.device, config.cpu_bytes, config)
    engine = memtest_engines.TorchEngine(chunks)
    return _run_plan(target, engine, chunks, _host_available_bytes(), config)


def allocate(device: torch.device, target_bytes: int, config: MemtestConfig) -> list[torch.Tensor]:
    """int32 chunks adding up to at most `target_bytes`; halve the chunk size when one fails."""
    chunks: list[torch.Tensor] = []
    remaining = target_bytes - target_bytes % 16
    size = config.chunk_bytes
    smallest = min(_MIN_CHUNK_BYTES, remaining)
    while remaining >= 16:
        size = min(size, remaining)
        size -= size % 16
        try:
            chunks.append(torch.empty(size // 4, dtype=torch.int32, device=device))
        except torch.OutOfMemoryError:
            if size // 2 < smallest:
                break
            size //= 2
            continue
        remaining -= size
    if not chunks:
        raise RuntimeError(f"memtest could not allocate even {smallest} bytes on {device}")
    return chunks


def _host_available_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _run_plan(
    target: devices.Target,
    engine: memtest_engines.Engine,
    chunks: list[torch.Tensor],
    free_bytes: int,
    config: MemtestConfig,
) -> MemtestOutcome:
    total_words = sum(c.numel() for c in chunks)
    faults = _faults_per_chunk(chunks, config.fault)
    passes = plan(config)
    moved = 0
    start = time.perf_counter()
    for _name, steps in passes:
        for step in steps:
            order = reversed(range(len(chunks))) if step.descending else range(len(chunks))
            for i in order:
                step.apply(engine, i, faults[i])
            moved += step.bytes_per_word * total_words
    if target.is_cuda:
        torch.cuda.synchronize(target.device)
    seconds = time.perf_counter() - start
    count, first = engine.errors()
    if count:
        log.warning(
            "memtest on %s: %d failing words, first at word %s", target.device_id, count, first
        )
    return MemtestOutcome(
        tested_bytes=total_words * 4,
        free_bytes=free_bytes,
        failing_words=count,
        first_failing_word=first,
        bytes_moved=moved,
        seconds=seconds,
        passes=tuple(name for name, _ in passes),
    )


def _faults_per_chunk(chunks: list[torch.Tensor], fault: MemFault | None) -> list[tuple[int, int]]:
    out = [NO_FAULT] * len(chunks)
    if fault is None:
        return out
    base = 0
    for i, chunk in enumerate(chunks):
        if base <= fault.index < base + chunk.numel():
            out[i] = (fault.index - base, fault.mask)
            return out
        base += chunk.numel()
    raise ValueError(f"memory fault index {fault.index} is past the {base} words tested")


def measurements(outcome: MemtestOutcome) -> list[measurement.Measurement]:
    return [
        measurement.Measurement(
            test="memtest.failing_words",
            value=float(outcome.failing_words),
            unit="count",
            kind=measurement.Kind.ERRORS,
            note=f"first failing word {outcome.first_failing_word}"
            if outcome.failing_words
            else "",
        ),
        measurement.Measurement(
            test="memtest.coverage",
            value=outcome.coverage,
            unit="fraction",
            kind=measurement.Kind.INFO,
        ),
        measurement.Measurement(
            test="memtest.bandwidth", value=outcome.tb_per_s * 1000, unit="GB/s"
        ),
    ]
