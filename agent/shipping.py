"""Ships record batches to the collector, spooling to a bounded on-disk queue while it is away.

Contract (docs/architecture.md, vigil.api): POST `encode_batch` frames to `INGEST_PATH` with the
batch id header; 2xx = committed (idempotent by batch id), 4xx = rejected for good (counted, logged,
never retried), 5xx / connection error / timeout = retried with backoff, then spooled. The spool
replays oldest first before anything newer is sent, so the collector sees batches in order; past
its byte bound it drops the oldest batches and counts their records.

Runs only on a background thread (the SDK's flusher or the agent's loop). Never imports the
collector.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx

from vigil import api, codec, schema
from vigil.agent import config

log = logging.getLogger(__name__)


def backoff_delays(initial_s: float, max_s: float, attempts: int) -> Iterator[float]:
    """The one backoff schedule: 0 before the first attempt, then doubling up to `max_s`."""
    delay = initial_s
    for attempt in range(attempts):
        yield 0.0 if attempt == 0 else delay
        if attempt:
            delay = min(delay * 2.0, max_s)


@dataclasses.dataclass(frozen=True)
class SpooledBatch:
    path: Path
    batch_id: str
    num_records: int


class Spool:
    """Batches waiting for the collector, one file each, named so sorting gives send order."""

    def __init__(self, directory: Path, *, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.dropped_batches = 0
        self.dropped_records = 0
        existing = self.pending()
        self._next = int(existing[-1].path.name.split("-", 1)[0]) + 1 if existing else 0

    def push(self, batch_id: str, num_records: int, frame: bytes) -> None:
        name = f"{self._next:016d}-{num_records}-{batch_id}.vgl"
        self._next += 1
        tmp = self.directory / f".{name}.tmp"
        tmp.write_bytes(frame)
        os.replace(tmp, self.directory / name)
        self._enforce_bound()

    def pending(self) -> list[SpooledBatch]:
        batches = []
        for path in sorted(self.directory.glob("*.vgl")):
            _, count, batch_id = path.stem.split("-", 2)
            batches.append(SpooledBatch(path, batch_id, int(count)))
        return batches

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("*.vgl"))

    def _enforce_bound(self) -> None:
        batches = self.pending()
        sizes = [b.path.stat().st_size for b in batches]
        total = sum(sizes)
        for batch, size in zip(batches, sizes, strict=True):
            if total <= self.max_bytes:
                break
            batch.path.unlink(missing_ok=True)
            total -= size
            self.dropped_batches += 1
            self.dropped_records += batch.num_records
            log.warning(
                "spool over %d bytes: dropped batch %s (%d records)",
                self.max_bytes,
                batch.batch_id,
                batch.num_records,
            )


@dataclasses.dataclass
class ShipperStats:
    shipped_batches: int = 0
    shipped_records: int = 0
    ship_errors: int = 0
    rejected_batches: int = 0


class Shipper:
    """A `sinks.Sink` that POSTs to the collector and spools what it cannot deliver."""

    def __init__(
        self,
        cfg: config.ShipperConfig,
        *,
        source: str = "",
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.spool = Spool(cfg.spool_dir, max_bytes=cfg.spool_max_bytes)
        self.stats = ShipperStats()
        self._sleep = sleep
        headers = {"Content-Type": api.BATCH_MEDIA_TYPE}
        if cfg.token:
            headers["Authorization"] = f"Bearer {cfg.token}"
        self._client = client or httpx.Client(
            base_url=cfg.collector_url, timeout=cfg.timeout_s, headers=headers
        )

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
            frames.append((batch_id, len(chunk), frame))
        if not self.replay():
            for batch_id, count, frame in frames:
                self.spool.push(batch_id, count, frame)
            return
        for index, (batch_id, count, frame) in enumerate(frames):
            if not self._deliver(batch_id, count, frame):
                for later in frames[index:]:
                    self.spool.push(*later)
                return

    def replay(self) -> bool:
        """Send spooled batches oldest first; False if the collector is still unreachable."""
        for batch in self.spool.pending():
            try:
                frame = batch.path.read_bytes()
            except FileNotFoundError:  # dropped by the bound meanwhile
                continue
            if not self._deliver(batch.batch_id, batch.num_records, frame):
                return False
            batch.path.unlink(missing_ok=True)
        return True

    def _deliver(self, batch_id: str, count: int, frame: bytes) -> bool:
        """True when the batch is settled (committed or rejected); False to keep it."""
        cfg = self.cfg
        for delay in backoff_delays(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.max_attempts):
            self._sleep(delay)
            try:
                response = self._client.post(
                    api.INGEST_PATH, content=frame, headers={api.BATCH_ID_HEADER: batch_id}
                )
            except httpx.HTTPError as exc:
                self.stats.ship_errors += 1
                log.debug("ship %s failed: %s", batch_id, exc)
                if isinstance(exc, httpx.ConnectError):
                    return False  # nobody listening: retrying now cannot help, spool it
                continue
            if response.is_success:
                self.stats.shipped_batches += 1
                self.stats.shipped_records += count
                return True
            if 400 <= response.status_code < 500:
                self.stats.rejected_batches += 1
                log.error(
                    "collector rejected batch %s (%d records): %s %s",
                    batch_id,
                    count,
                    response.status_code,
                    response.text[:500],
                )
                return True
            self.stats.ship_errors += 1
        return False

    def close(self) -> None:
        self._client.close()
