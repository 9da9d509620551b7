"""When every rank of a framework-trained job (HF Trainer, Lightning) saves a requested checkpoint.

A request reaches each rank through its own progress page, and ranks see it at their own next
step boundary, which may differ by a step. Trainer's save is collective under FSDP (the state
dict is gathered) and writes one folder per step from every rank (each rank's RNG state), so
all ranks must save after the same step. `SaveAgreement` agrees without stalling a step, in
rounds: at a round's step end the training thread hands the number of requests this rank has
seen to a thread of the agreement's own, which MAX-all-reduces it over a gloo group of its own
(also on NCCL jobs), and the next step end takes the answer, long there by then because the
job's own collectives of the step ran after it. A rise of the agreed count means "save at this
step end", on every rank at once, once per request even when ranks saw it steps apart.

Rounds are `gap` step ends apart: as many steps as fit in `ROUND_S` seconds, 1 to
`MAX_GAP_STEPS`. Each round also agrees the next gap (every rank proposes one from its own step
time since the last round, the smallest wins), so all ranks run the same rounds at the same step
ends without a word more. A round costs every rank ~1 ms of CPU on a busy 2-core host (this
thread's wake-up, gloo's loop and run threads for the group, the loop thread most of it): a
round at every ~100 ms step was ~1 % of the process's CPU, one per `ROUND_S` is ~0.1 %. The
bound on a save: at most `MAX_GAP_STEPS` step ends after the first rank saw the request, the
next step end when steps take `ROUND_S` or longer. A request a rank sees in the job's last
`gap` steps may find no round left: training ends before the ranks agree to save. Alone (one
process, no process group) a request is honoured at the step end it is seen.

The all-reduce goes to the process group object directly, not through `torch.distributed`'s
functions, so vigil's collective timing does not count it as the job's communication; it runs
off the training thread because starting one and waiting for it there costs a busy CPU host
~0.3 ms of that thread's CPU, against ~30 us for handing it over.
Must not touch the job's own process groups.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How long a step end waits for the previous round's answer before giving the agreement up. The
# answer is normally there already; gloo's own timeout (30 min by default) ends a dead peer's.
ANSWER_TIMEOUT_S = 600.0
# Rounds: about one per this many seconds of training, and at least one per MAX_GAP_STEPS steps.
ROUND_S = 1.0
MAX_GAP_STEPS = 16
_STOP = (-1, 0)


def propose_gap(step_s: float | None) -> int:
    """This rank's proposal of the step ends between rounds, from its mean step time (None:
    not measured yet, the first round)."""
    if step_s is None or not step_s > 0 or not math.isfinite(step_s):
        return 1
    return max(1, min(MAX_GAP_STEPS, int(ROUND_S / step_s)))


class SaveAgreement:
    """Counts this rank's "checkpoint" requests and says at which step end to save."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen = 0  # requests this rank's SDK delivered
        self._agreed = 0  # the job-wide count already acted on
        self._group: Any = None
        self._own_group = False  # made by start(): destroyed by close()
        self._asks: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[tuple[int, int] | BaseException] = queue.SimpleQueue()
        self._ends = 0  # step ends so far (save_now calls): the same count on every rank
        self._next_round = 1  # the step end of the next round
        self._round = 0  # the step end of the last round asked
        self._round_t: float | None = None  # when it was asked
        self._owed = False  # the last round's answer is due at the next step end
        self._broken = False  # the agreement failed: no rank may save on its own
        self._thread: threading.Thread | None = None
        self.rounds = 0  # all-reduces asked (what the agreement cost)
        self.gap = 1  # the agreed step ends between rounds

    def start(self, group: Any = None) -> None:
        """Create the gloo group (a collective: call on every rank at the same point); `group`:
        one to agree over instead (any object with c10d's `allreduce(tensors, op)`)."""
        distributed = dist.is_available() and dist.is_initialized()
        if group is None and distributed and dist.get_world_size() > 1:
            group = dist.new_group(backend="gloo")
            self._own_group = True
        if group is not None:
            self._group = group
            self._thread = threading.Thread(
                target=self._reduce, args=(group,), name="vigil-save-agree", daemon=True
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
        self._ends += 1
        due = False
        if self._owed:  # the round asked at the last step end
            self._owed = False
            agreed, gap = self._answer()
            due = agreed > self._agreed
            self._agreed = max(self._agreed, agreed)
            self.gap = gap
            self._next_round = self._round + gap
        if self._ends == self._next_round:
            now = self._clock()
            since = self._round_t
            step_s = None if since is None else (now - since) / max(1, self._ends - self._round)
            self._round, self._round_t = self._ends, now
            self._asks.put((seen, propose_gap(step_s)))
            self._owed = True
            self.rounds += 1
        return due

    def _answer(self) -> tuple[int, int]:
        try:
            answer = self._answers.get(timeout=ANSWER_TIMEOUT_S)
        except queue.Empty:
            answer = TimeoutError(f"no checkpoint agreement within {ANSWER_TIMEOUT_S:.0f} s")
        if isinstance(answer, BaseException):
            self._broken = True  # checkpoint requests are honoured no more; training goes on
            raise RuntimeError(f"checkpoint agreement failed: {answer!r}") from answer
        return answer

    def _reduce(self, group: Any) -> None:
        # [requests seen, -proposed gap]: one MAX gives the most requests and the smallest gap.
        buffer = torch.zeros(2, dtype=torch.int64)
        while (ask := self._asks.get()) != _STOP:
            buffer[0], buffer[1] = ask[0], -ask[1]
            try:
                group.allreduce([buffer], dist.ReduceOp.MAX).wait()
            except Exception as exc:
                self._answers.put(exc)
                return
            agreed, gap = int(buffer[0]), -int(buffer[1])
            self._answers.put((agreed, max(1, min(MAX_GAP_STEPS, gap))))

    def close(self) -> None:
        """Take the last answer (every rank asked; none may leave the all-reduce open), then
        destroy the group `start` made (not a collective: each rank's own sockets and threads,
        so a process that trains many times does not keep one group per run)."""
        thread, self._thread = self._thread, None
        if self._owed and not self._broken:
            self._owed = False
            try:
                self._answer()
            except RuntimeError as exc:  # a peer gone at the end: nothing left to save
                log.debug("%s", exc)
        group, self._group = self._group, None
        if thread is not None:
            self._asks.put(_STOP)
            thread.join(timeout=ANSWER_TIMEOUT_S)
        done = thread is None or not thread.is_alive()
        if self._own_group and done and not self._broken and dist.is_initialized():
            self._own_group = False
            try:  # this rank's last round is done: all it sends for it is sent
                dist.destroy_process_group(group)
            except Exception as exc:  # already gone with the default group: nothing held
                log.debug("checkpoint agreement group: %r", exc)
