"""Deterministic training data: synthetic token streams and a byte-level reader for text files.

Every sequence is a pure function of (seed, step, global sample index), so a data-parallel rank
takes its slice of the global batch by index: the same step yields the same global batch for any
dp size, which is what lets a run resume exactly and reshard onto another dp size. This module
only produces tensors; it must not touch process groups or the model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import mmap
import random
from pathlib import Path

import torch

_NOISE = 0.1  # share of synthetic positions replaced by random tokens: learnable, not trivial


def _seed_of(seed: int, step: int, index: int, salt: str) -> int:
    key = hashlib.blake2b(f"{salt}:{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(key, "little") & (2**63 - 1)


@functools.lru_cache(maxsize=8)
def _successors(seed: int, vocab: int) -> list[int]:
    """The fixed token-to-next-token table of the synthetic language (a permutation)."""
    table = list(range(vocab))
    random.Random(_seed_of(seed, 0, 0, "successors")).shuffle(table)
    return table


def synthetic_sequence(
    *, seed: int, step: int, index: int, length: int, vocab: int
) -> torch.Tensor:
    """A Markov chain over a seeded successor table with random noise: learnable, not trivial."""
    rng = random.Random(_seed_of(seed, step, index, "synthetic"))
    table = _successors(seed, vocab)
    token = rng.randrange(vocab)
    out = [token]
    for _ in range(length - 1):
        token = rng.randrange(vocab) if rng.random() < _NOISE else table[token]
        out.append(token)
    return torch.tensor(out, dtype=torch.long)


class ByteCorpus:
    """A local file read as bytes (tokens 0..255) through mmap; windows start at seeded offsets."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 2:
            raise ValueError(f"text file {path} is too short to train on ({size} bytes)")
        with self.path.open("rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size

    def window(self, *, seed: int, step: int, index: int, length: int) -> torch.Tensor:
        span = min(length, self.size)
        offset = random.Random(_seed_of(seed, step, index, "bytes")).randrange(self.size - span + 1)
        raw = torch.frombuffer(bytearray(self._map[offset : offset + span]), dtype=torch.uint8)
        out = raw.long()
        if span < length:  # a file shorter than a sequence repeats itself
            out = out.repeat(length // span + 1)[:length]
        return out

    def close(self) -> None:
        self._map.close()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    inputs: torch.Tensor  # (batch, seq_len) token ids
    labels: torch.Tensor  # inputs shifted by one position


class BatchSource:
    """The per-rank slice of each step's global batch."""

    def __init__(
        self,
        *,
        seed: int,
        seq_len: int,
        vocab: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        text_path: Path | None = None,
    ) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} not divisible by dp size {dp_size}")
        if text_path is not None and vocab < 256:
            raise ValueError(f"byte-level text needs vocab_size >= 256, recipe has {vocab}")
        self.seed, self.seq_len, self.vocab = seed, seq_len, vocab
        self.local_batch = global_batch // dp_size
        self.first_index = dp_rank * self.local_batch
        self.device = device
        self.corpus = ByteCorpus(text_path) if text_path is not None else None

    def _sequence(self, step: int, index: int) -> torch.Tensor:
        length = self.seq_len + 1
        if self.corpus is not None:
            return self.corpus.window(seed=self.seed, step=step, index=index, length=length)
        return synthetic_sequence(
            seed=self.seed, step=step, index=index, length=length, vocab=self.vocab
        )

    def batch(self, step: int) -> Batch:
        indices = range(self.first_index, self.first_index + self.local_batch)
        rows = torch.stack([self._sequence(step, i) for i in indices])
        rows = rows.to(self.device, non_blocking=True)
        return Batch(inputs=rows[:, :-1], labels=rows[:, 1:])

    def close(self) -> None:
        if self.corpus is not None:
            self.corpus.close()
