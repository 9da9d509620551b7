"""Trainer tests run single-process reference runs in the pytest process itself: one intra-op
thread, as each spawned rank uses, keeps them fast on a busy shared host (OpenMP threads
spin-wait on each other when other processes hold the cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
