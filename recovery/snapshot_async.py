"""Per-step snapshots that do not stall training: stage on the training thread, write and
replicate in the background, at most one snapshot in flight.

`BackgroundSnapshotter.save` asks every rank whether its previous snapshot has finished (one
one-integer all-reduce over a gloo group of its own, so every rank snapshots the same steps and a
restore always finds a step all ranks hold); when one has not, the step's snapshot is skipped and
counted (`SnapshotStats.num_skipped`). Otherwise it stages the state into host buffers
(`snapshot_stage`) and hands it to a background thread that finishes the copies, serialises the
tree into node shared memory (`Snapshotter.write_primary`) and exchanges it with the peer node
(`Snapshotter.replicate`) over a second gloo group, so replication never queues behind the
job's own collectives (on NCCL jobs these groups carry CPU tensors). Hooks never raise into
training: errors are logged and counted. Must not touch the job's own process groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from vigil.recovery import snapshot, snapshot_stage

log = logging.getLogger(__name__)

# How long close() waits for the snapshot in flight (its peer must finish the same exchange).
CLOSE_TIMEOUT_S = 120.0
# The writer thread's niceness above the process's (Linux: per thread): where the node has no
# idle core, training threads get the CPU first, and snapshots are skipped instead.
WRITER_NICE = 10


@dataclasses.dataclass(kw_only=True)
class SnapshotStats:
    """What the snapshots of this rank cost and achieved (read by users, benches and tests)."""

    num_saved: int = 0  # snapshots written to this node (and sent to the peer when there is one)
    num_skipped: int = 0  # steps whose snapshot was skipped: a previous one was still in flight
    num_failed: int = 0  # snapshots that could not be staged, written or replicated
    num_replicas: int = 0  # peers' snapshots this rank kept
    last_step: int = -1  # the newest step written here
    stall_s_total: float = 0.0  # training-thread time: staging, the agreement, update waits
    stall_s_last: float = 0.0  # the same for the newest snapshot
    agree_s_total: float = 0.0  # of the stall: the agreement all-reduce, past the last arrival
    skew_s_total: float = 0.0  # not in the stall: waiting there for the last rank to arrive,
    # which the job's next collective would have waited anyway
    wait_s_total: float = 0.0  # of the stall: optimizer steps waiting for deferred copies
    write_s_last: float = 0.0  # background time of the newest snapshot (copy, write, replicate)
    bytes_last: int = 0  # staged bytes of the newest snapshot

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


class BackgroundSnapshotter:
    """Snapshots `Snapshotter.files`' rank asynchronously; construct on every rank at once."""

    def __init__(self, files: snapshot.Snapshotter, *, agree_group: Any = None) -> None:
        self.files = files
        self.distributed = dist.is_available() and dist.is_initialized()
        self.agree_group = agree_group
        self.stats = SnapshotStats()
        self._stager = snapshot_stage.Stager()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._current: snapshot_stage.Staged | None = None

    @classmethod
    def create(cls, files: snapshot.Snapshotter) -> BackgroundSnapshotter:
        """With the two gloo groups of its own (a collective: every rank calls it together)."""
        if dist.is_available() and dist.is_initialized():
            files.group = dist.new_group(backend="gloo")
            return cls(files, agree_group=dist.new_group(backend="gloo"))
        return cls(files)

    # ----- the training thread --------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """This rank's previous snapshot is written (for callers that agree on it themselves)."""
        return self._idle.is_set()

    def save(
        self,
        step: int,
        capture: Callable[[], tuple[Any, Callable[[torch.Tensor], bool]]],
        *,
        all_ready: bool | None = None,
    ) -> bool:
        """Stage the tree `capture()` returns for `step` (with the test for tensors whose copy
        may wait for the next optimizer step) and return at once; False when skipped or failed.

        `all_ready`: every rank's `ready`, when the caller has agreed on it already (in a
        collective of its own); else one small all-reduce decides.
        """
        started = time.perf_counter()
        skew = 0.0
        try:
            if all_ready is None:
                all_ready, skew = self._all_idle()
            if not all_ready:
                self.stats.num_skipped += 1
                return False
            tree, deferred = capture()
            staged = self._stager.stage(tree, deferred)
            self._idle.clear()
            self._current = staged
            # A thread per snapshot: it starts at the training thread's priority for the copies
            # the next optimizer step waits for, then lowers its own for the write.
            self._thread = threading.Thread(
                target=self._run, args=(step, staged), name="vigil-snapshot", daemon=True
            )
            self._thread.start()
            return True
        except Exception:
            log.exception("snapshot of step %d could not be staged", step)
            self.stats.num_failed += 1
            self._idle.set()
            return False
        finally:
            spent = time.perf_counter() - started - skew
            self.stats.stall_s_last = spent
            self.stats.stall_s_total += spent
            self.stats.skew_s_total += skew

    def before_update(self) -> None:
        """Called before the state changes (an optimizer step): wait for the deferred copies."""
        staged = self._current
        if staged is None:
            return
        try:
            waited = staged.wait_for_update()
        except Exception:
            log.exception("waiting for a snapshot's copies failed")
            self.stats.num_failed += 1
            return
        self.stats.stall_s_last += waited
        self.stats.stall_s_total += waited
        self.stats.wait_s_total += waited

    def _all_idle(self) -> tuple[bool, float]:
        """Whether every rank's previous snapshot is written, and the seconds this rank waited
        for the last one to arrive (wall clocks; on several hosts an estimate)."""
        if not (self.distributed and self.files.world_size > 1):
            return self._idle.is_set(), 0.0
        started, arrived = time.perf_counter(), time.time()
        flags = torch.tensor([0.0 if self._idle.is_set() else 1.0, arrived], dtype=torch.float64)
        snapshot.all_reduce(flags, dist.ReduceOp.MAX, self.agree_group)
        spent = time.perf_counter() - started
        skew = min(spent, max(0.0, float(flags[1]) - arrived))
        self.stats.agree_s_total += spent - skew
        return float(flags[0]) == 0.0, skew

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until the snapshot in flight is written and replicated; False on timeout."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if not self.flush(timeout_s):
            log.warning("a snapshot was still in flight after %.0f s; leaving it", timeout_s)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=timeout_s)

    # ----- the background thread ------------------------------------------------------------
    def _run(self, step: int, staged: snapshot_stage.Staged) -> None:
        started = time.perf_counter()
        try:
            self._write(step, staged)
        finally:
            self._current = None if self._current is staged else self._current
            self.stats.write_s_last = time.perf_counter() - started
            self._idle.set()

    def _write(self, step: int, staged: snapshot_stage.Staged) -> None:
        path = None
        try:
            staged.finish_copies()
            _lower_priority()
            if staged.broken:
                raise RuntimeError("the optimizer stepped before the snapshot's copies finished")
            path = self.files.write_primary(step, staged.tree)
            self.stats.bytes_last = staged.bytes
        except Exception:
            log.exception("snapshot of step %d could not be written", step)
            self.stats.num_failed += 1
        if self.files.replicates:
            try:  # even without a file of ours: the peer's exchange pairs with this one
                if self.files.replicate(step, path) >= 0:
                    self.stats.num_replicas += 1
            except Exception:
                log.exception("snapshot of step %d could not be replicated", step)
                self.stats.num_failed += 1
                return
        if path is not None:
            self.stats.num_saved += 1
            self.stats.last_step = step


def _lower_priority() -> None:
    """Make this thread yield the CPU to training (Linux: niceness is per thread)."""
    with contextlib.suppress(OSError, AttributeError):  # best effort
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + WRITER_NICE))
