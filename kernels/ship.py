"""Sends diag results to a collector, as interfaces.md says senders must.

POST `{collector}{vigil.api.INGEST_PATH}` with a codec batch frame. 2xx is committed (a
duplicate batch id too); 4xx is a permanent rejection, logged and never retried; 5xx, connection
errors and timeouts are retried with exponential backoff, then the frame is spooled to disk so
nothing is lost. The HTTP client and the sleep function are injectable.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from vigil import api, codec, schema

log = logging.getLogger(__name__)


class Delivery(enum.StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    SPOOLED = "spooled"
    LOST = "lost"  # collector down and no spool directory configured


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
    batch_id = codec.new_batch_id()
    frame = codec.encode_batch(records, batch_id=batch_id, source="vigil-diag")
    headers = {"Content-Type": api.BATCH_MEDIA_TYPE, api.BATCH_ID_HEADER: batch_id}
    if config.token:
        headers["Authorization"] = f"Bearer {config.token}"
    url = config.url.rstrip("/") + api.INGEST_PATH
    own = client is None
    http = client or httpx.Client(timeout=config.timeout_s)
    try:
        detail = ""
        for attempt in range(config.attempts):
            if attempt:
                sleep(config.backoff_s * 2 ** (attempt - 1))
            try:
                response = http.post(url, content=frame, headers=headers, timeout=config.timeout_s)
            except httpx.HTTPError as exc:
                detail = f"{type(exc).__name__}: {exc}"
                log.warning("collector unreachable (attempt %d): %s", attempt + 1, detail)
                continue
            if response.is_success:
                return ShipOutcome(delivery=Delivery.ACCEPTED, batch_id=batch_id)
            detail = f"HTTP {response.status_code}: {response.text[:500]}"
            if 400 <= response.status_code < 500:
                log.error("collector rejected diag batch %s: %s", batch_id, detail)
                return ShipOutcome(delivery=Delivery.REJECTED, batch_id=batch_id, detail=detail)
            log.warning("collector error (attempt %d): %s", attempt + 1, detail)
    finally:
        if own:
            http.close()
    return _spool(frame, batch_id, config, detail)


def _spool(frame: bytes, batch_id: str, config: ShipConfig, detail: str) -> ShipOutcome:
    if config.spool_dir is None:
        log.error(
            "diag batch %s lost: collector unavailable (%s) and no spool dir", batch_id, detail
        )
        return ShipOutcome(
            delivery=Delivery.SPOOLED, batch_id=batch_id, detail=f"not spooled: {detail}"
        )
    config.spool_dir.mkdir(parents=True, exist_ok=True)
    path = config.spool_dir / f"{batch_id}.vgl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(frame)
    tmp.replace(path)  # atomic: a reader never sees half a frame
    log.warning("collector unavailable (%s): diag batch spooled to %s", detail, path)
    return ShipOutcome(delivery=Delivery.SPOOLED, batch_id=batch_id, detail=str(path))
