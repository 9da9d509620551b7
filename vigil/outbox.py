"""Batches on their way to the collector: framed, sent, spooled while it is away, replayed.

`Outbox` frames records (`codec.encode_batch`, a batch id each) and sends them through a
`sender.Sender`. Each round sends the spool oldest first, then the new batches. What an answer
means is `delivery.classify`: a 4xx that retrying cannot change is quarantined at once; 5xx is
retried with backoff, and a batch that keeps getting it while other batches are committed is
quarantined after `max_server_errors` answers; connection errors, timeouts and 401/403/408/429
keep the batch in the spool and end the round. A refused batch is stepped over (the next one
still goes); two refused in a row end the round. Past its byte bound the spool drops the oldest
batches and counts their records.

`Orphans` replays spools that exited processes left behind (an SDK rank's, an earlier
`vigil diag` run's): it claims a spool only when its owner is gone (`spool.Spool.claim`), sends
it oldest first until it is empty, then removes it. Delivery is at least once: the collector
dedupes batch ids.

Runs on whichever thread sends (the SDK's flusher, the agent's loop, a CLI) and, at shutdown,
the thread stopping it. Imports no subsystem.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import httpx

from vigil import codec, delivery, schema, sender, spool

log = logging.getLogger(__name__)
Outcome = delivery.Outcome


class Fate(enum.StrEnum):
    """What became of one new batch by the end of its round."""

    COMMITTED = "committed"
    QUARANTINED = "quarantined"  # refused for good: kept in the spool's quarantine/, not resent
    SPOOLED = "spooled"  # waits in the spool for a later round


class Posted(NamedTuple):
    batch_id: str
    fate: Fate
    detail: str  # the collector's answer or the error ("" when committed)


class _Fresh(NamedTuple):
    """A batch framed this round, not spooled (yet)."""

    batch_id: str
    num_records: int
    frame: bytes
    seq: int | None = None  # its reserved place in the spool's send order


class Outbox:
    """POSTs batches to the collector and spools what it cannot deliver (a `Sink` for the SDK)."""

    def __init__(
        self,
        cfg: sender.SenderConfig,
        *,
        source: str = "",
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        shared_sender: sender.Sender | None = None,
        spooled: spool.Spool | None = None,
        retried: str = "every flush",
    ) -> None:
        """`shared_sender`: another outbox's sender, so that one HTTP client, its counters and
        outage log serve both (replays of orphaned spools); `spooled`: a spool opened already
        (claimed); `retried` words the outage log (when the spool goes again)."""
        self.cfg = cfg
        self.source = source
        if spooled is None:
            if cfg.spool_dir is None:
                raise ValueError("an Outbox needs spool_dir (where undelivered batches wait)")
            spooled = spool.open_spool(
                cfg.spool_dir,
                max_bytes=cfg.spool_max_bytes,
                max_quarantined=cfg.max_quarantined_batches,
            )
        self.spool = spooled
        self._owns_sender = shared_sender is None
        self.sender = shared_sender or sender.Sender(
            cfg, client=client, sleep=sleep, clock=clock, retried=retried
        )
        self.stats = self.sender.stats
        # batch id -> (5xx answers so far, batches committed when it was first refused)
        self._refusals: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()  # one round at a time
        self._close_pending = False  # close() came while a round was still under way
        self._quarantine_log = delivery.Throttle(cfg.warn_interval_s, clock)

    def finish_by(self, deadline: float) -> None:
        self.sender.finish_by(deadline)

    def write(self, records: Sequence[schema.Record]) -> None:
        """Frame `records` (`max_batch_records` a batch); send spooled batches first, then
        these (spooling what fails)."""
        step = self.cfg.max_batch_records
        self._send([self._frame(records[i : i + step]) for i in range(0, len(records), step)])

    def post(self, records: Sequence[schema.Record], *, batch_id: str | None = None) -> Posted:
        """Send `records` as one batch (`batch_id`, or a fresh one) after the spooled ones;
        what became of it."""
        fresh = self._frame(records, batch_id)
        fates = self._send([fresh])
        return fates.get(fresh.batch_id, Posted(fresh.batch_id, Fate.SPOOLED, ""))

    def replay(self) -> bool:
        """Send spooled batches oldest first; False if the round ended with the collector away."""
        if not self._acquire():
            return False
        try:
            return self._round([], {})
        finally:
            self._release()

    def _frame(self, records: Sequence[schema.Record], batch_id: str | None = None) -> _Fresh:
        batch_id = batch_id or codec.new_batch_id()
        frame = codec.encode_batch(
            records, batch_id=batch_id, source=self.source, compress=self.cfg.compress
        )
        return _Fresh(batch_id, len(records), frame)

    def _send(self, frames: list[_Fresh]) -> dict[str, Posted]:
        fates: dict[str, Posted] = {}
        if not self._acquire():  # still sending when the deadline came: keep these for later
            for fresh in frames:
                self._push(fresh, "still sending at the shutdown deadline", fates)
            return fates
        try:
            first = self.spool.reserve(len(frames))
            self._round([f._replace(seq=first + i) for i, f in enumerate(frames)], fates)
        finally:
            self._release()
        return fates

    def _acquire(self) -> bool:
        remaining = self.sender.remaining_s()
        return self._lock.acquire(timeout=-1 if remaining is None else remaining)

    def _release(self) -> None:
        if self._close_pending:
            self._close_pending = False
            self._close()
        self._lock.release()

    def _round(self, fresh: list[_Fresh], fates: dict[str, Posted]) -> bool:
        """One pass over the spool, then `fresh`; fills `fates` for the fresh batches."""
        items: list[spool.SpooledBatch | _Fresh] = [*self.spool.pending(), *fresh]
        refused_in_a_row = 0
        for index, item in enumerate(items):
            frame = item.frame if isinstance(item, _Fresh) else _read(item)
            if frame is None:
                continue
            result = self.sender.send(item.batch_id, item.num_records, frame)
            outcome = result.outcome
            if outcome is Outcome.COMMITTED:
                refused_in_a_row = 0
                self._settled(item, fates)
                self.sender.outage.delivered(pending_batches=len(self.spool))
                continue
            if outcome is Outcome.REJECTED or self._poison(item, result):
                self._quarantine(item, frame, result.detail, fates)
                continue
            stop = outcome is Outcome.UNAVAILABLE or refused_in_a_row > 0
            refused_in_a_row += 1
            if isinstance(item, _Fresh):
                self._push(item, result.detail, fates)
            if stop:
                for later in items[index + 1 :]:
                    if isinstance(later, _Fresh):
                        self._push(later, "not sent: the collector is away", fates)
                self.sender.outage.failed(
                    result.detail,
                    pending_batches=len(self.spool),
                    pending_bytes=self.spool.size_bytes(),
                )
                return False
            log.info("collector refused batch %s: %s; next", item.batch_id, result.detail)
        return True

    def _poison(self, item: spool.SpooledBatch | _Fresh, result: sender.Result) -> bool:
        if not result.refusals:
            return False
        commits = self.stats.shipped_batches
        before, first_at = self._refusals.get(item.batch_id, (0, commits))
        refusals = before + result.refusals
        self._refusals[item.batch_id] = (refusals, first_at)
        return delivery.is_poison(
            refusals=refusals,
            commits_at_first_refusal=first_at,
            commits_now=commits,
            max_refusals=self.cfg.max_server_errors,
        )

    def _settled(self, item: spool.SpooledBatch | _Fresh, fates: dict[str, Posted]) -> None:
        self._refusals.pop(item.batch_id, None)
        if isinstance(item, spool.SpooledBatch):
            self.spool.remove(item)
        else:
            fates[item.batch_id] = Posted(item.batch_id, Fate.COMMITTED, "")

    def _quarantine(
        self,
        item: spool.SpooledBatch | _Fresh,
        frame: bytes,
        detail: str,
        fates: dict[str, Posted],
    ) -> None:
        self._refusals.pop(item.batch_id, None)
        if isinstance(item, _Fresh):
            self.spool.quarantine_frame(item.batch_id, item.num_records, frame)
            fates[item.batch_id] = Posted(item.batch_id, Fate.QUARANTINED, detail)
        else:
            self.spool.quarantine(item)
        self.stats.quarantined_batches += 1
        held_back = self._quarantine_log.ready()
        if held_back is not None:
            log.warning(
                "collector at %s keeps refusing batch %s (%d records): %s; quarantined under %s "
                "(%d quarantined in all, %d since the last message)",
                self.cfg.collector_url,
                item.batch_id,
                item.num_records,
                detail,
                self.spool.directory / spool.QUARANTINE_DIR,
                self.stats.quarantined_batches,
                held_back + 1,
            )

    def _push(
        self, fresh: _Fresh, detail: str = "", fates: dict[str, Posted] | None = None
    ) -> None:
        pushed = self.spool.push(fresh.batch_id, fresh.num_records, fresh.frame, seq=fresh.seq)
        for dropped in pushed:
            self._refusals.pop(dropped.batch_id, None)
        if fates is not None:
            fates[fresh.batch_id] = Posted(fresh.batch_id, Fate.SPOOLED, detail)

    def close(self) -> None:
        """Close the sender (when this outbox's own) and release the spool; when a send is
        still under way at the shutdown deadline, the sending thread does it when it ends."""
        if not self._acquire():
            self._close_pending = True
            log.warning("still sending to %s at the shutdown deadline", self.cfg.collector_url)
            return
        try:
            self._close()
        finally:
            self._lock.release()

    def _close(self) -> None:
        if self._owns_sender:
            self.sender.close()
        self.spool.close()


def _read(batch: spool.SpooledBatch) -> bytes | None:
    try:
        return batch.path.read_bytes()
    except FileNotFoundError:  # dropped by the bound meanwhile
        return None


class Orphans:
    """Replays the spools that exited processes left in the folders `find` lists."""

    def __init__(
        self,
        find: Callable[[], Iterable[Path]],
        *,
        cfg: sender.SenderConfig,
        shared_sender: sender.Sender,
        skip: Path | None = None,
        proc_root: Path = spool.PROC_ROOT,
    ) -> None:
        """`find` lists candidate spool folders (each call); `skip` is the caller's own."""
        self._find = find
        self._cfg = cfg
        self._sender = shared_sender
        self._skip = skip
        self._proc_root = proc_root
        self._claimed: dict[Path, Outbox] = {}
        self.replayed_spools = 0

    def tick(self) -> bool:
        """Claim new orphans, then replay each claimed spool until the collector stops taking;
        False when it did (what is left waits for the next tick)."""
        self._claim_new()
        for path, box in list(self._claimed.items()):
            if not box.replay():
                return False
            if len(box.spool) == 0:
                del self._claimed[path]
                box.spool.close_and_remove_if_empty()
                box.close()
                self.replayed_spools += 1
                log.info("replayed the spool %s of an exited process", path)
        return True

    def _claim_new(self) -> None:
        for path in self._find():
            if path in self._claimed or path == self._skip:
                continue
            try:
                claimed = spool.Spool.claim(
                    path,
                    max_bytes=self._cfg.spool_max_bytes,
                    max_quarantined=self._cfg.max_quarantined_batches,
                    proc_root=self._proc_root,
                )
            except OSError as exc:
                log.debug("cannot claim spool %s: %s", path, exc)
                continue
            if claimed is None:
                continue
            if len(claimed) == 0:
                claimed.close_and_remove_if_empty()
                continue
            owner = claimed.previous_owner
            log.info(
                "replaying %d batches (%d bytes) that pid %d left in %s",
                len(claimed),
                claimed.size_bytes(),
                owner.pid if owner else -1,
                path,
            )
            self._claimed[path] = Outbox(self._cfg, shared_sender=self._sender, spooled=claimed)

    @property
    def pending_batches(self) -> int:
        return sum(len(box.spool) for box in self._claimed.values())

    def close(self) -> None:
        """Release the claimed spools (what is left in them waits for the next claimant)."""
        for box in self._claimed.values():
            box.close()
        self._claimed.clear()
