"""The collector's settings: bind address, store URL, auth tokens, ingest limits, retention.

Read from VIGIL_* variables (declared in `vigil.env`) through `CommonSettings`; built in `main()` or
by tests, never at import time. Must not open the store or touch the network.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from vigil import codec
from vigil.collector import validate
from vigil.settings import CommonSettings

log = logging.getLogger(__name__)

_LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}


def is_loopback(host: str) -> bool:
    """True when `host` only accepts connections from this machine."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_tokens(value: object) -> object:
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    return value


class CollectorSettings(CommonSettings):
    """Everything `vigil collector` and `create_app` need; see `vigil.env` for the variables."""

    # Loopback by default: without tokens the collector must not be reachable from the network.
    collector_host: str = "127.0.0.1"
    # 8470: unassigned by IANA, easy to remember ("vigil" on a phone keypad starts with 84).
    collector_port: int = Field(default=8470, ge=0, le=65535)
    # Empty means the embedded SQLite store `<data_dir>/collector.sqlite3`.
    store_url: str = ""
    # Tokens allowed to POST batches; VIGIL_TOKEN (CommonSettings.token) grants both scopes.
    ingest_tokens: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Tokens allowed to read the query API.
    read_tokens: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # The codec's own bounds: 32 MiB on the wire, 1M records per batch (see vigil.codec).
    max_batch_bytes: int = Field(default=codec.DEFAULT_MAX_BYTES, ge=1024)
    max_batch_records: int = Field(default=codec.DEFAULT_MAX_RECORDS, ge=1)
    max_batch_inflated_bytes: int = Field(default=codec.DEFAULT_MAX_DECOMPRESSED_BYTES, ge=1024)
    # The largest world size a job may declare (and so the largest rank + 1): above the largest
    # training jobs run today, and it bounds what one job can make the collector allocate.
    max_world_size: int = Field(default=131_072, ge=1, le=validate.MAX_RANK + 1)
    # Kineto traces are tens of MB; 256 MiB leaves room for a large rank's window.
    max_trace_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    # Raw samples, heartbeats and collective events expire after 7 days; step records stay.
    raw_retention_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    # Rollups (one row per sample series and minute) make month-long ranges cheap to read.
    rollup_bucket_s: float = Field(default=60.0, gt=0)
    # Retention and rollups run once a minute: cheap, and raw data never outlives its age by much.
    maintenance_interval_s: float = Field(default=60.0, gt=0)
    # Hang detection needs a tick when no records arrive; once a second matches heartbeat rates.
    analyzer_tick_s: float = Field(default=1.0, gt=0)
    # Seconds a request may take to send its headers (from its first byte): half-sent requests
    # must not hold connections before auth is even checked.
    header_timeout_s: float = Field(default=10.0, gt=0)
    # Connections and in-flight requests served at once; past it new ones get a 503.
    max_connections: int = Field(default=2048, ge=1)
    # With auth on: whether /metrics answers without a token (it holds counts by record type
    # and reason, no job data; scrapers then need no secret) and whether /docs and
    # /openapi.json do (they map the whole API; off by default).
    metrics_public: bool = True
    docs_public: bool = False
    # Batches queued for the streaming analyzer, and the records they hold together; past
    # either a batch is stored but not analysed (counted in
    # vigil_collector_analyzer_dropped_batches_total), so ingest never waits for it and its
    # queue's memory stays bounded (~200 bytes a record). Senders ship per rank: a 10,000-rank
    # job sends ~10,000 batches (~160,000 records) a second, which the analyzer takes merged.
    # Concurrent ingest requests share a transaction (collector/commits.py); off: one each.
    ingest_group_commit: bool = True
    analyzer_max_pending: int = Field(default=16_384, ge=1)
    analyzer_max_pending_records: int = Field(default=500_000, ge=1)

    @field_validator("ingest_tokens", "read_tokens", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return _split_tokens(value)

    @field_validator("store_url")
    @classmethod
    def _known_store(cls, value: str) -> str:
        if value and not value.startswith(("sqlite://", "postgresql")):
            raise ValueError(
                f"store URL {value!r} must start with sqlite:/// or postgresql+psycopg://"
            )
        if value.startswith("postgresql://") or value.startswith("postgres://"):
            return "postgresql+psycopg://" + value.split("://", 1)[1]
        return value

    @model_validator(mode="after")
    def _refuse_open_bind(self) -> CollectorSettings:
        if not self.auth_enabled and not is_loopback(self.collector_host) and not self.dev_mode:
            raise ValueError(
                f"refusing to bind {self.collector_host} without tokens: set VIGIL_INGEST_TOKENS "
                "and VIGIL_READ_TOKENS (or VIGIL_TOKEN), bind 127.0.0.1, or set VIGIL_DEV_MODE=1"
            )
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.ingest_tokens or self.read_tokens or self.token)

    @property
    def resolved_store_url(self) -> str:
        """The store URL, defaulting to the embedded SQLite file under the data directory."""
        if self.store_url:
            return self.store_url
        return f"sqlite:///{Path(self.data_dir) / 'collector.sqlite3'}"

    def tokens_for(self, scope: str) -> frozenset[str]:
        """Tokens that grant `scope` ("ingest" or "read")."""
        tokens = self.ingest_tokens if scope == "ingest" else self.read_tokens
        shared = [self.token] if self.token else []
        return frozenset([*tokens, *shared])
