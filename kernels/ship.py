"""Sends `vigil diag` results to a collector through the core sender (`vigil.outbox`).

One batch per run, per the ingest contract: 2xx is committed (a duplicate batch id too); a 4xx
that retrying cannot change is final (the batch is kept in the spool's `quarantine/`, never
resent); 5xx, connection errors, timeouts and 401/403/408/429 are retried with the core's
backoff schedule, then the batch waits in the spool (`vigil.spool`, bounded). The next run sends
what earlier runs left there first, and the spools of earlier runs that were still running (or
whose folder was busy) once their process is gone; the node agent replays the same folder
(`vigil.spool.diag_dir`) on its own. Without a spool directory an undelivered batch is lost,
and said to be. The HTTP client and the sleep function are injectable.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from vigil import codec, delivery, outbox, schema, sender, spool

log = logging.getLogger(__name__)

SOURCE = "vigil-diag"
# A run's batch is a few KiB: 16 MiB keeps thousands of runs while the collector is away.
SPOOL_MAX_BYTES = 16 * 1024 * 1024
_RETRIED = "at the next `vigil diag` run (or by the node agent)"


class Delivery(enum.StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    SPOOLED = "spooled"
    LOST = "lost"  # not delivered and no spool directory configured


@dataclass(frozen=True, kw_only=True)
class ShipConfig:
    url: str
    token: str | None = None
    # 10 s per attempt: a healthy collector answers a small batch in milliseconds.
    timeout_s: float = 10.0
    attempts: int = 4
    backoff_s: float = 0.5
    spool_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"collector URL {self.url!r} must start with http:// or https://")
        if self.timeout_s <= 0 or self.attempts < 1 or self.backoff_s < 0:
            raise ValueError("shipping needs timeout_s > 0, attempts >= 1 and backoff_s >= 0")

    def sender_config(self) -> sender.SenderConfig:
        """The core sender's settings: waits of backoff_s, then doubling, per attempt."""
        return sender.SenderConfig(
            collector_url=self.url,
            spool_dir=self.spool_dir,
            token=self.token,
            spool_max_bytes=SPOOL_MAX_BYTES,
            timeout_s=self.timeout_s,
            max_attempts=self.attempts,
            backoff_initial_s=self.backoff_s,
            backoff_max_s=self.backoff_s * 2 ** max(0, self.attempts - 2),
        )


@dataclass(frozen=True, kw_only=True)
class ShipOutcome:
    delivery: Delivery
    batch_id: str
    detail: str = ""


def send(
    records: Sequence[schema.Record],
    config: ShipConfig,
    *,
    client: httpx.Client | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ShipOutcome:
    """Ship `records` as one batch after what earlier runs left; what became of it."""
    cfg = config.sender_config()
    if config.spool_dir is None:
        return _send_unspooled(records, cfg, client=client, sleep=sleep)
    box = outbox.Outbox(cfg, source=SOURCE, client=client, sleep=sleep, retried=_RETRIED)
    try:
        posted = box.post(records)
        if posted.fate is not outbox.Fate.SPOOLED:  # the collector is there: earlier runs' too
            _replay_earlier(config.spool_dir, cfg, box)
    finally:
        box.close()
    if posted.fate is outbox.Fate.COMMITTED:
        return ShipOutcome(delivery=Delivery.ACCEPTED, batch_id=posted.batch_id)
    if posted.fate is outbox.Fate.QUARANTINED:
        log.error("collector rejected diag batch %s: %s", posted.batch_id, posted.detail)
        return ShipOutcome(
            delivery=Delivery.REJECTED, batch_id=posted.batch_id, detail=posted.detail
        )
    return ShipOutcome(
        delivery=Delivery.SPOOLED, batch_id=posted.batch_id, detail=str(box.spool.directory)
    )


def _replay_earlier(directory: Path, cfg: sender.SenderConfig, box: outbox.Outbox) -> None:
    """Send what earlier runs left in the sibling spools (`open_spool`'s fallbacks) whose
    process is gone."""
    earlier = outbox.Orphans(
        lambda: spool.siblings(directory),
        cfg=cfg,
        shared_sender=box.sender,
        skip=box.spool.directory,
    )
    try:
        earlier.tick()
    finally:
        earlier.close()


def _send_unspooled(
    records: Sequence[schema.Record],
    cfg: sender.SenderConfig,
    *,
    client: httpx.Client | None,
    sleep: Callable[[float], None],
) -> ShipOutcome:
    batch_id = codec.new_batch_id()
    frame = codec.encode_batch(records, batch_id=batch_id, source=SOURCE)
    post = sender.Sender(cfg, client=client, sleep=sleep)
    try:
        result = post.send(batch_id, len(records), frame)
    finally:
        post.close()
    if result.outcome is delivery.Outcome.COMMITTED:
        return ShipOutcome(delivery=Delivery.ACCEPTED, batch_id=batch_id)
    if result.outcome is delivery.Outcome.REJECTED:
        log.error("collector rejected diag batch %s: %s", batch_id, result.detail)
        return ShipOutcome(delivery=Delivery.REJECTED, batch_id=batch_id, detail=result.detail)
    log.error(
        "diag batch %s lost: collector unavailable (%s) and no spool dir", batch_id, result.detail
    )
    return ShipOutcome(delivery=Delivery.LOST, batch_id=batch_id, detail=result.detail)
