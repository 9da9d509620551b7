"""The two engines behind the memory test: CUDA kernels (csrc/memtest.cu) and torch ops on CPU.

Both expose one interface over a list of chunks: fill a chunk with a pattern, verify a chunk
against one, or verify-then-write (moving inversions), counting failing words and keeping the
lowest failing word index over all chunks. The CUDA engine builds its extension at run time
with torch.utils.cpp_extension.load (nvcc must be on PATH or under CUDA_HOME); the pass plan
and the allocation of memory live in `vigil.kernels.memtest`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
CONSTANT, ADDRESS, ADDRESS_INVERTED = 0, 1, 2
NO_FAULT = (-1, 0)
_WORD = 4
_NO_ERROR = (1 << 63) - 1
_MASK32 = 0xFFFFFFFF


class Engine(Protocol):
    def fill(self, chunk: int, kind: int, pattern: int, fault: tuple[int, int]) -> None: ...

    def verify(self, chunk: int, kind: int, pattern: int) -> None: ...

    def verify_write(
        self, chunk: int, expect: int, write: int, descending: bool, fault: tuple[int, int]
    ) -> None: ...

    def errors(self) -> tuple[int, int | None]:
        """(failing words, lowest failing word index over all chunks or None)."""
        ...


def signed(word: int) -> int:
    """A uint32 bit pattern as the int32 torch stores."""
    word &= _MASK32
    return word - (1 << 32) if word >= 1 << 31 else word


class TorchEngine:
    """The CPU path: the same passes with torch ops (walk direction does not apply here)."""

    def __init__(self, chunks: Sequence[torch.Tensor]) -> None:
        self._chunks = list(chunks)
        self._bases = _bases(self._chunks)
        self._count = 0
        self._first: int | None = None

    def _expected(self, buf: torch.Tensor, kind: int, pattern: int) -> torch.Tensor:
        if kind == CONSTANT:
            return torch.full_like(buf, signed(pattern))
        start = buf.data_ptr() // _WORD
        words = (torch.arange(buf.numel(), dtype=torch.int64) + start) & _MASK32
        if kind == ADDRESS_INVERTED:
            words = words ^ _MASK32
        return (words - ((words >> 31) << 32)).to(torch.int32)

    def fill(self, chunk: int, kind: int, pattern: int, fault: tuple[int, int]) -> None:
        buf = self._chunks[chunk]
        buf.copy_(self._expected(buf, kind, pattern))
        _plant(buf, fault)

    def verify(self, chunk: int, kind: int, pattern: int) -> None:
        buf = self._chunks[chunk]
        self._check(chunk, buf, self._expected(buf, kind, pattern))

    def verify_write(
        self, chunk: int, expect: int, write: int, descending: bool, fault: tuple[int, int]
    ) -> None:
        buf = self._chunks[chunk]
        self._check(chunk, buf, torch.full_like(buf, signed(expect)))
        buf.fill_(signed(write))
        _plant(buf, fault)

    def _check(self, chunk: int, buf: torch.Tensor, want: torch.Tensor) -> None:
        differs = buf != want
        if not bool(differs.any()):
            return
        bad = differs.nonzero()
        if bad.numel():
            self._count += bad.numel()
            first = self._bases[chunk] + int(bad[0].item())
            self._first = first if self._first is None else min(self._first, first)

    def errors(self) -> tuple[int, int | None]:
        return self._count, self._first


def _plant(buf: torch.Tensor, fault: tuple[int, int]) -> None:
    index, mask = fault
    if index >= 0:
        buf[index] ^= signed(mask)


class CudaEngine:
    """The CUDA path: kernels from csrc/memtest.cu on the device's current stream."""

    def __init__(self, module: Any, chunks: Sequence[torch.Tensor]) -> None:
        if not chunks:
            raise ValueError("the CUDA memory test needs at least one chunk")
        self._module = module
        self._chunks = list(chunks)
        self._bases = _bases(self._chunks)
        device = self._chunks[0].device
        # One [count, lowest index] pair per chunk: kernels log chunk-local word indices.
        self._log = torch.tensor([[0, _NO_ERROR]] * len(chunks), dtype=torch.int64, device=device)
        self._stream = torch.cuda.current_stream(device).cuda_stream

    def fill(self, chunk: int, kind: int, pattern: int, fault: tuple[int, int]) -> None:
        self._module.fill(self._chunks[chunk], kind, pattern, fault[0], fault[1], self._stream)

    def verify(self, chunk: int, kind: int, pattern: int) -> None:
        self._module.verify(self._chunks[chunk], kind, pattern, self._log[chunk], self._stream)

    def verify_write(
        self, chunk: int, expect: int, write: int, descending: bool, fault: tuple[int, int]
    ) -> None:
        self._module.verify_write(
            self._chunks[chunk],
            expect,
            write,
            descending,
            self._log[chunk],
            fault[0],
            fault[1],
            self._stream,
        )

    def errors(self) -> tuple[int, int | None]:
        rows = self._log.tolist()
        count = sum(c for c, _ in rows)
        firsts = [base + f for base, (c, f) in zip(self._bases, rows, strict=True) if c]
        return count, (min(firsts) if firsts else None)


def _bases(chunks: Sequence[torch.Tensor]) -> list[int]:
    bases, total = [], 0
    for chunk in chunks:
        bases.append(total)
        total += chunk.numel()
    return bases


_module: Any = None


def build_cuda_module(build_dir: Path | None = None) -> Any:
    """Compile (once per process; cached on disk by torch) and load the memtest extension."""
    global _module
    if _module is None:
        from torch.utils import cpp_extension

        if build_dir is not None:
            build_dir.mkdir(parents=True, exist_ok=True)
        log.info("building the CUDA memory test extension (first run compiles with nvcc)")
        _module = cpp_extension.load(
            name="vigil_memtest",
            sources=[str(CSRC / "memtest_binding.cpp"), str(CSRC / "memtest.cu")],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_directory=str(build_dir) if build_dir else None,
            verbose=False,
        )
    return _module
