"""The one sender of the ingest contract: POST a framed batch with its id, retry, count.

Contract (docs/architecture.md, `vigil.api`): POST an `encode_batch` frame to `INGEST_PATH`
with the batch id header; 2xx = committed (idempotent by batch id). What else an answer means
is `delivery.classify`; retries follow `delivery.backoff_delays`. Connection refused ends the
attempts at once (nobody is listening); timeouts and resets are retried.

`finish_by` bounds what is left of a sender's life: no POST starts after the deadline and each
one's timeout is clipped to it.

`Sender` sends one frame; `vigil.outbox.Outbox` frames records, spools what does not go and
replays it. Used by the SDK and node agent, `vigil diag` and the recovery controller; imports
no subsystem.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx

from vigil import api, delivery, spool

log = logging.getLogger(__name__)
Outcome = delivery.Outcome

# 64 MiB of spooled batches hold hours of one rank's step records and aggregates.
DEFAULT_SPOOL_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_SERVER_ERRORS = 5


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SenderConfig:
    """How batches travel to the collector and how much is kept while it is away."""

    collector_url: str
    # Where undelivered batches wait (`vigil.spool`); an `Outbox` needs one, a bare `Sender` not.
    spool_dir: Path | None = None
    token: str | None = None
    # Disk the spool may use; past it the oldest batches are dropped (and counted).
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    # 5 s bounds one POST: a healthy collector answers in milliseconds, a wedged one must not
    # stall the shipping thread for longer than a couple of flush intervals.
    timeout_s: float = 5.0
    # Attempts per batch before it goes to the spool; the spool is retried on every round.
    max_attempts: int = 3
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    # Records per POST: one rank's step produces ~10 records, so this is one flush of many steps.
    max_batch_records: int = 5000
    compress: bool = True
    # 5xx answers one batch may get before it is quarantined (once the collector has committed
    # other batches meanwhile): a handful of rounds tells a batch the collector fails on from a
    # hiccup, without holding the batches behind it up for long.
    max_server_errors: int = DEFAULT_MAX_SERVER_ERRORS
    # Quarantined batch files kept for inspection; the oldest go first.
    max_quarantined_batches: int = spool.DEFAULT_MAX_QUARANTINED
    # While the collector stays away, one WARNING at first, then at most one a minute.
    warn_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.spool_dir is not None and not isinstance(self.spool_dir, Path):
            object.__setattr__(self, "spool_dir", Path(self.spool_dir))
        _require(
            self.collector_url.startswith(("http://", "https://")),
            f"collector URL {self.collector_url!r} must start with http:// or https://",
        )
        _require(self.spool_max_bytes > 0, "spool_max_bytes must be > 0")
        _require(self.timeout_s > 0, "timeout_s must be > 0 (seconds per POST)")
        _require(self.max_attempts >= 1, "max_attempts must be >= 1")
        _require(
            0 <= self.backoff_initial_s <= self.backoff_max_s,
            "need 0 <= backoff_initial_s <= backoff_max_s",
        )
        _require(self.max_batch_records >= 1, "max_batch_records must be >= 1")
        _require(self.max_server_errors >= 1, "max_server_errors must be >= 1")
        _require(self.max_quarantined_batches >= 0, "max_quarantined_batches must be >= 0")
        _require(self.warn_interval_s > 0, "warn_interval_s must be > 0")

    @property
    def ingest_url(self) -> str:
        return self.collector_url.rstrip("/") + api.INGEST_PATH


@dataclasses.dataclass
class SenderStats:
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
    """POSTs one frame with retries and backoff; counts; shared by the outboxes of one process."""

    def __init__(
        self,
        cfg: SenderConfig,
        *,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        retried: str = "every flush",
    ) -> None:
        """`client` may be any httpx client (no base URL needed: the sender posts to the full
        ingest URL with its own headers); `retried` words the outage log."""
        self.cfg = cfg
        self.stats = SenderStats()
        self.outage = delivery.OutageLog(
            cfg.collector_url, interval_s=cfg.warn_interval_s, clock=clock, retried=retried
        )
        self._sleep = sleep
        self._clock = clock
        self._deadline: float | None = None
        self._headers = {"Content-Type": api.BATCH_MEDIA_TYPE}
        if cfg.token:
            self._headers["Authorization"] = f"Bearer {cfg.token}"
        self._owns_client = client is None
        self._client = client or httpx.Client(timeout=cfg.timeout_s)

    def finish_by(self, deadline: float) -> None:
        """From now on no POST starts after `deadline` (the clock's time) or outlasts it."""
        self._deadline = deadline

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (never negative), or None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - self._clock())

    def send(self, batch_id: str, count: int, frame: bytes) -> Result:
        """POST `frame` (`count` records) until it is settled or the attempts run out."""
        cfg = self.cfg
        refusals, detail = 0, ""
        for delay in delivery.backoff_delays(
            cfg.backoff_initial_s, cfg.backoff_max_s, cfg.max_attempts
        ):
            remaining = self.remaining_s()
            if remaining is not None and remaining <= delay:
                return Result(Outcome.UNAVAILABLE, detail or "shutdown deadline reached", refusals)
            if delay:
                self._sleep(delay)
            timeout = cfg.timeout_s if remaining is None else min(cfg.timeout_s, remaining - delay)
            try:
                response = self._client.post(
                    cfg.ingest_url,
                    content=frame,
                    headers={**self._headers, api.BATCH_ID_HEADER: batch_id},
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
        """Close the HTTP client when this sender made it."""
        if self._owns_client:
            self._client.close()
