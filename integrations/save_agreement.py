"""When every rank of a framework-trained job (HF Trainer, Lightning) saves a requested checkpoint.

A request reaches each rank through its own progress page, and ranks see it at their own next
step boundary, which may differ by a step. Trainer's save is collective under FSDP (the state
dict is gathered) and writes one folder per step from every rank (each rank's RNG state), so
all ranks must save after the same step. `SaveAgreement` agrees without stalling a step: at
each step end the training thread hands the number of requests this rank has seen to a thread
of the agreement's own, which MAX-all-reduces it over a gloo group of its own (also on NCCL
jobs), and takes the previous step's answer, long there by then because the job's own
collectives of the step ran after it. A rise of the agreed count means "save at this step end":
one step after the first rank saw the request, once per request even when ranks saw it a step
apart. Alone (one process, no process group) the request is honoured at the step end it is
seen.

The all-reduce goes to the process group object directly, not through `torch.distributed`'s
functions, so vigil's collective timing does not count it as the job's communication; it runs
off the training thread because starting one costs a busy CPU host a fraction of a millisecond.
Must not touch the job's own process groups.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How long a step end waits for the previous step's answer before giving the agreement up. The
# answer is normally there already; gloo's own timeout (30 min by default) ends a dead peer's.
ANSWER_TIMEOUT_S = 600.0
_STOP = -1


class SaveAgreement:
    """Counts this rank's "checkpoint" requests and says at which step end to save."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen = 0  # requests this rank's SDK delivered
        self._agreed = 0  # the job-wide count already acted on
        self._group: Any = None
        self._asks: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        self._owed = False  # an answer for the previous step end is due
        self._broken = False  # the agreement failed: no rank may save on its own
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Create the gloo group (a collective: call on every rank at the same point)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
            self._thread = threading.Thread(
                target=self._reduce, args=(self._group,), name="vigil-hf-agree", daemon=True
            )
            self._thread.start()

    def request(self) -> None:
        """The SDK's "checkpoint" callback (runs in the training thread at a step boundary)."""
        with self._lock:
            self._seen += 1

    def save_now(self) -> bool:
        """Called at every step end, on every rank: whether this step end saves."""
        with self._lock:
            seen = self._seen
        if self._broken:
            return False
        if self._group is None:
            due = seen > self._agreed
            self._agreed = max(self._agreed, seen)
            return due
        due = False
        if self._owed:
            self._owed = False
            agreed = self._answer()
            due = agreed > self._agreed
            self._agreed = max(self._agreed, agreed)
        self._asks.put(seen)
        self._owed = True
        return due

    def _answer(self) -> int:
        try:
            answer = self._answers.get(timeout=ANSWER_TIMEOUT_S)
        except queue.Empty:
            answer = TimeoutError(f"no checkpoint agreement within {ANSWER_TIMEOUT_S:.0f} s")
        if isinstance(answer, BaseException):
            self._broken = True  # checkpoint requests are honoured no more; training goes on
            raise RuntimeError(f"checkpoint agreement failed: {answer!r}") from answer
        return answer

    def _reduce(self, group: Any) -> None:
        buffer = torch.zeros(1, dtype=torch.int64)
        while (seen := self._asks.get()) != _STOP:
            buffer[0] = seen
            try:
                group.allreduce([buffer], dist.ReduceOp.MAX).wait()
            except Exception as exc:
                self._answers.put(exc)
                return
            self._answers.put(int(buffer[0]))

    def close(self) -> None:
        """Take the last answer (every rank asked; none may leave the all-reduce open)."""
        thread, self._thread = self._thread, None
        if self._owed and not self._broken:
            self._owed = False
            try:
                self._answer()
            except RuntimeError as exc:  # a peer gone at the end: nothing left to save
                log.debug("%s", exc)
        self._group = None
        if thread is not None:
            self._asks.put(_STOP)
            thread.join(timeout=ANSWER_TIMEOUT_S)
