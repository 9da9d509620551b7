"""Staging a live training state into host memory for a snapshot: the only work a snapshot
does on the training thread.

`Stager.stage` walks a state tree (model and optimizer state dicts, extra state) and returns a
`Staged` tree of host tensors with the same structure. Buffers are allocated once and reused
(pinned on CUDA, so device-to-host copies run asynchronously). Tensors that only the optimizer
changes (parameters, optimizer state: `deferred`) are not copied at once: on CUDA their copies are
queued on a side stream; on CPU the background writer copies them (`Staged.finish_copies`). The
next optimizer step waits for those copies (`Staged.wait_for_update`), since forward and backward
do not touch parameters. Everything else (module buffers such as BatchNorm statistics, extra
state, non-tensor leaves) is copied before `stage` returns. DTensors (FSDP2 shards, tensor-parallel
slices) become their local tensors. Writes no files and starts no threads.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# How long an optimizer step waits for a background copy before giving up on the snapshot's
# consistency (the copy then sees the updated values; the writer drops that snapshot).
UPDATE_WAIT_S = 600.0


@dataclass
class Staged:
    """One staged snapshot: a host tree, and the copies still to be made into it."""

    tree: Any
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    bytes: int = 0
    _copied: threading.Event = field(default_factory=threading.Event)
    _cuda_done: Any = None  # a torch.cuda.Event on the side stream (CUDA only)
    _current_done: Any = None  # a torch.cuda.Event on the training stream (CUDA only)
    broken: bool = False  # an optimizer step ran before the copies finished (waited too long)

    def finish_copies(self) -> None:
        """Make the deferred copies (background thread); on CUDA wait for the queued ones."""
        try:
            if self._cuda_done is not None:
                self._cuda_done.synchronize()
                self._current_done.synchronize()
            for dst, src in self.pending:
                dst.copy_(src)
        finally:
            self._copied.set()

    @property
    def copied(self) -> bool:
        return self._copied.is_set()

    def wait_for_update(self, timeout_s: float = UPDATE_WAIT_S) -> float:
        """Block until the state may change (the optimizer is about to step); seconds waited.

        On CUDA the training stream waits for the side stream instead (no host block).
        """
        if self._cuda_done is not None:
            torch.cuda.current_stream().wait_event(self._cuda_done)
        if not self.pending or self._copied.is_set():
            return 0.0
        started = time.perf_counter()
        if not self._copied.wait(timeout_s):
            self.broken = True
        return time.perf_counter() - started


class Stager:
    """Stages state trees into reusable host buffers (one set, so one snapshot in flight)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: Any = None

    def stage(self, tree: Any, deferred: Callable[[torch.Tensor], bool]) -> Staged:
        staged = Staged(tree=None)
        cuda: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        staged.tree = self._walk(tree, "", deferred, staged, cuda)
        if cuda:
            self._queue_cuda(cuda, staged)
        return staged

    def _walk(
        self,
        node: Any,
        path: str,
        deferred: Callable[[torch.Tensor], bool],
        staged: Staged,
        cuda: list[tuple[torch.Tensor, torch.Tensor, bool]],
    ) -> Any:
        if isinstance(node, torch.Tensor):
            local = node.to_local() if isinstance(node, DTensor) else node
            local = local.detach()
            buf = self._buffer(path, local)
            staged.bytes += buf.numel() * buf.element_size()
            later = deferred(local)
            if local.is_cuda:
                cuda.append((buf, local, later))
            elif later:
                staged.pending.append((buf, local))
            else:
                buf.copy_(local)
            return buf
        if isinstance(node, dict):
            return {
                k: self._walk(v, f"{path}/{k}", deferred, staged, cuda) for k, v in node.items()
            }
        if isinstance(node, list | tuple):
            items = [
                self._walk(v, f"{path}[{i}]", deferred, staged, cuda) for i, v in enumerate(node)
            ]
            if isinstance(node, tuple):
                return tuple(items) if type(node) is tuple else type(node)(*items)
            return items
        return copy.deepcopy(node)

    def _buffer(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.is_cuda and torch.cuda.is_available()
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        return buf

    def _queue_cuda(
        self, copies: list[tuple[torch.Tensor, torch.Tensor, bool]], staged: Staged
    ) -> None:
        """Device-to-host copies into pinned buffers: the deferred ones on a side stream that
        first waits for the training stream, the rest on the training stream (so the next
        forward, which may change buffers, runs after them)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream()
        for buf, src, later in copies:
            if not later:
                buf.copy_(src, non_blocking=True)
        staged._current_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        staged._current_done.record(current)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for buf, src, later in copies:
                if later:
                    buf.copy_(src, non_blocking=True)
            staged._cuda_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            staged._cuda_done.record(self._stream)
