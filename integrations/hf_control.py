"""When every rank of a Hugging Face Trainer job saves the checkpoint a request asks for.

A request reaches each rank through its own progress page, and ranks see it at their own next
step boundary, which may differ by a step. Trainer's save is collective under FSDP (the state
dict is gathered) and writes one folder per step from every rank (each rank's RNG state), so
all ranks must save after the same step. `SaveAgreement` agrees without stalling a step: at
each step end it starts a one-integer MAX all-reduce of the number of requests this rank has
seen, over a gloo group of its own (also on NCCL jobs), and reads the previous step's result,
long finished by then because the job's own collectives of the step ran after it. A rise of the
agreed count means "save at this step end": one step after the first rank saw the request, once
per request even when ranks saw it a step apart. Alone (one process, no process group) the
request is honoured at the step end it is seen.

The all-reduce goes to the process group object directly, not through `torch.distributed`'s
functions, so vigil's collective timing does not count it as the job's communication.
Must not touch the job's own process groups.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class SaveAgreement:
    """Counts this rank's "checkpoint" requests and says at which step end to save."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen = 0  # requests this rank's SDK delivered
        self._agreed = 0  # the job-wide count already acted on
        self._group: Any = None
        self._work: Any = None
        self._buffer = torch.zeros(1, dtype=torch.int64)

    def start(self) -> None:
        """Create the gloo group (a collective: call on every rank at the same point)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")

    def request(self) -> None:
        """The SDK's "checkpoint" callback (runs in the training thread at a step boundary)."""
        with self._lock:
            self._seen += 1

    def save_now(self) -> bool:
        """Called at every step end, on every rank: whether this step end saves."""
        with self._lock:
            seen = self._seen
        if self._group is None:
            due = seen > self._agreed
            self._agreed = seen
            return due
        due = False
        if self._work is not None:
            if not self._work.is_completed():
                self._work.wait()
            agreed = int(self._buffer[0])
            due = agreed > self._agreed
            self._agreed = max(self._agreed, agreed)
        self._buffer[0] = seen
        self._work = self._group.allreduce([self._buffer], dist.ReduceOp.MAX)
        return due

    def close(self) -> None:
        """Finish the all-reduce in flight (every rank started it; none may leave it open)."""
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except Exception as exc:  # a peer gone at the end: nothing to save
                log.debug("checkpoint agreement ended without its last answer: %r", exc)
        self._group = None
