"""Ships record batches to the collector, spooling to a bounded on-disk queue while it is away.

Contract (docs/architecture.md, vigil.api): POST `encode_batch` frames to `INGEST_PATH` with the
batch id header; 2xx = committed (idempotent by batch id). What else an answer means is
`delivery.classify`: a 4xx that retrying cannot change is quarantined at once; 5xx is retried
with backoff, and a batch that keeps getting it while other batches are committed is quarantined
after `max_server_errors` answers; connection errors, timeouts, 401/403/408/429 keep the batch
in the spool and end the round. Each round sends the spool oldest first, then the new batches; a
refused batch is stepped over (the next one still goes), two refused in a row end the round.
Past its byte bound the spool drops the oldest batches and counts their records.

`finish_by` bounds what is left of a sender's life: no POST starts after the deadline, each one's
timeout is clipped to it, and what is not delivered by then stays in the spool.

Runs only on a background thread (the SDK's flusher or the agent's loop) and, at shutdown, the
thread stopping it. Never imports the collector.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import httpx

from vigil import api, codec, schema
from vigil.agent import config, delivery, spool

log = logging.getLogger(__name__)
Outcome = delivery.Outcome


def backoff_delays(initial_s: float, max_s: float, attempts: int) -> Iterator[float]:
    """The one backoff schedule: 0 before the first attempt, then doubling up to `max_s`."""
    delay = initial_s
    for attempt in range(attempts):
        yield 0.0 if attempt == 0 else delay
        if attempt:
            delay = min(delay * 2.0, max_s)


@dataclasses.dataclass
class ShipperStats:
    shipped_batches: int = 0
    shipped_records: int = 0
    ship_errors: int = 0
    rejected_batches: int = 0
    quarantined_batches: int = 0


class Result(NamedTuple):
    outcome: delivery.Outcome
    detail: str  # what went wrong, for the log ("" when committed)
    refusals: int  # 5xx answers among the attempts


class Sender:
    """POSTs one frame with retries and backoff; counts; shared by the shippers of one process."""

    def __init__(
        self,
        cfg: config.ShipperConfig,
        *,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.stats = ShipperStats()
        self.outage = delivery.OutageLog(
            cfg.collector_url, interval_s=cfg.warn_interval_s, clock=clock
        )
        self._sleep = sleep
        self._clock = clock
        self._deadline: float | None = None
        headers = {"Content-Type": api.BATCH_MEDIA_TYPE}
        if cfg.token:
            headers["Authorization"] = f"Bearer {cfg.token}"
        self._client = client or httpx.Client(
            base_url=cfg.collector_url, timeout=cfg.timeout_s, headers=headers
        )

    def finish_by(self, deadline: float) -> None:
        """From now on no POST starts after `deadline` (the clock's time) or outlasts it."""
        self._deadline = deadline

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (never negative), or None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - self._clock())

    def send(self, batch_id: str, count: int, frame: bytes) -> Result:
        cfg = self.cfg
        refusals, detail = 0, ""
        for delay in backoff_delays(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.max_attempts):
            remaining = self.remaining_s()
            if remaining is not None and remaining <= delay:
                return Result(Outcome.UNAVAILABLE, detail or "shutdown deadline reached", refusals)
            self._sleep(delay)
            timeout = cfg.timeout_s if remaining is None else min(cfg.timeout_s, remaining - delay)
            try:
                response = self._client.post(
                    api.INGEST_PATH,
                    content=frame,
                    headers={api.BATCH_ID_HEADER: batch_id},
                    timeout=timeout,
                )
            except httpx.HTTPError as exc:
                self.stats.ship_errors += 1
                detail = f"{type(exc).__name__}: {exc}"
                log.debug("ship %s failed: %s", batch_id, detail)
                if isinstance(exc, httpx.ConnectError):
                    return Result(Outcome.UNAVAILABLE, detail, refusals)  # nobody listening
                continue  # timeouts, resets: retried
            outcome = delivery.classify(response.status_code)
            if outcome is Outcome.COMMITTED:
                self.stats.shipped_batches += 1
                self.stats.shipped_records += count
                return Result(outcome, "", refusals)
            detail = f"HTTP {response.status_code}: {response.text[:300]}"
            if outcome is Outcome.REJECTED:
                self.stats.rejected_batches += 1
                return Result(outcome, detail, refusals)
            self.stats.ship_errors += 1
            if outcome is Outcome.UNAVAILABLE:
                return Result(outcome, detail, refusals)
            refusals += 1
        return Result(Outcome.REFUSED if refusals else Outcome.UNAVAILABLE, detail, refusals)

    def close(self) -> None:
        self._client.close()


class _Fresh(NamedTuple):
    """A batch framed this round, not spooled (yet)."""

    batch_id: str
    num_records: int
    frame: bytes
    seq: int | None = None  # its reserved place in the spool's send order


class Shipper:
    """A `sinks.Sink` that POSTs to the collector and spools what it cannot deliver."""

    def __init__(
        self,
        cfg: config.ShipperConfig,
        *,
        source: str = "",
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        sender: Sender | None = None,
        spooled: spool.Spool | None = None,
    ) -> None:
        """`sender` shares one HTTP client, its counters and outage log (the agent's replays
        of orphaned spools); `spooled` is a spool opened already (claimed)."""
        self.cfg = cfg
        self.source = source
        self.spool = spooled or spool.open_spool(
            cfg.spool_dir,
            max_bytes=cfg.spool_max_bytes,
            max_quarantined=cfg.max_quarantined_batches,
        )
        self._owns_sender = sender is None
        self.sender = sender or Sender(cfg, client=client, sleep=sleep, clock=clock)
        self.stats = self.sender.stats
        # batch id -> (5xx answers so far, batches committed when it was first refused)
        self._refusals: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()  # one round at a time
        self._close_pending = False  # close() came while a round was still under way
        self._quarantine_log = delivery.Throttle(cfg.warn_interval_s, clock)

    def finish_by(self, deadline: float) -> None:
        self.sender.finish_by(deadline)

    def write(self, records: Sequence[schema.Record]) -> None:
        """Frame `records`; send spooled batches first, then these (spooling what fails)."""
        frames = []
        step = self.cfg.max_batch_records
        for start in range(0, len(records), step):
            chunk = records[start : start + step]
            batch_id = codec.new_batch_id()
            frame = codec.encode_batch(
                chunk, batch_id=batch_id, source=self.source, compress=self.cfg.compress
            )
            frames.append(_Fresh(batch_id, len(chunk), frame))
        if not self._acquire():  # still sending when the deadline came: keep these for later
            for fresh in frames:
                self._push(fresh)
            return
        try:
            first = self.spool.reserve(len(frames))
            self._round([f._replace(seq=first + i) for i, f in enumerate(frames)])
        finally:
            self._release()

    def replay(self) -> bool:
        """Send spooled batches oldest first; False if the round ended with the collector away."""
        if not self._acquire():
            return False
        try:
            return self._round([])
        finally:
            self._release()

    def _acquire(self) -> bool:
        remaining = self.sender.remaining_s()
        return self._lock.acquire(timeout=-1 if remaining is None else remaining)

    def _release(self) -> None:
        if self._close_pending:
            self._close_pending = False
            self._close()
        self._lock.release()

    def _round(self, fresh: list[_Fresh]) -> bool:
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
                self._settled(item)
                self.sender.outage.delivered(pending_batches=len(self.spool))
                continue
            if outcome is Outcome.REJECTED or self._poison(item, result):
                self._quarantine(item, frame, result.detail)
                continue
            stop = outcome is Outcome.UNAVAILABLE or refused_in_a_row > 0
            refused_in_a_row += 1
            if isinstance(item, _Fresh):
                self._push(item)
            if stop:
                for later in items[index + 1 :]:
                    if isinstance(later, _Fresh):
                        self._push(later)
                self.sender.outage.failed(
                    result.detail,
                    pending_batches=len(self.spool),
                    pending_bytes=self.spool.size_bytes(),
                )
                return False
            log.info("collector refused batch %s: %s; next", item.batch_id, result.detail)
        return True

    def _poison(self, item: spool.SpooledBatch | _Fresh, result: Result) -> bool:
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

    def _settled(self, item: spool.SpooledBatch | _Fresh) -> None:
        self._refusals.pop(item.batch_id, None)
        if isinstance(item, spool.SpooledBatch):
            self.spool.remove(item)

    def _quarantine(self, item: spool.SpooledBatch | _Fresh, frame: bytes, detail: str) -> None:
        self._refusals.pop(item.batch_id, None)
        if isinstance(item, _Fresh):
            self.spool.quarantine_frame(item.batch_id, item.num_records, frame)
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

    def _push(self, fresh: _Fresh) -> None:
        pushed = self.spool.push(fresh.batch_id, fresh.num_records, fresh.frame, seq=fresh.seq)
        for dropped in pushed:
            self._refusals.pop(dropped.batch_id, None)

    def close(self) -> None:
        """Close the HTTP client (when this shipper's own) and release the spool; when a send
        is still under way at the shutdown deadline, the sending thread does it when it ends."""
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
