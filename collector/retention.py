"""Retention: roll raw samples up into per-minute buckets, then expire raw rows past their age.

Raw samples, heartbeats and collective events expire `raw_retention_s` after they were received;
step records, collective aggregates, findings, actions, checkpoints and diag results stay. Rollups
(count/sum/min/max per series and bucket) keep long ranges answerable after raw samples are gone.
Rollups advance a watermark on `received_s` that trails the clock by a grace period, so a batch
still being committed is never skipped. Must not touch step records.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, cast, delete, func, select, tuple_
from sqlalchemy.engine import Connection

from vigil.collector import dialects, tables
from vigil.collector.store import STATEMENT_TIMEOUT_S, Store

log = logging.getLogger(__name__)

WATERMARK_KEY = "samples_rollup_received_s"
# A batch's rows carry the received_s taken before its transaction began; no transaction lives
# longer than the statement timeout, so rows older than that are all committed.
GRACE_S = STATEMENT_TIMEOUT_S + 5.0


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    raw_retention_s: float
    rollup_bucket_s: float

    def __post_init__(self) -> None:
        if not self.raw_retention_s > GRACE_S:
            raise ValueError(f"raw_retention_s must exceed {GRACE_S} s, got {self.raw_retention_s}")
        if not self.rollup_bucket_s > 0:
            raise ValueError(f"rollup_bucket_s must be > 0, got {self.rollup_bucket_s}")


@dataclass(frozen=True, kw_only=True)
class MaintenanceReport:
    rolled_up: int
    expired: dict[str, int]


def watermark(conn: Connection) -> float:
    """received_s below which every raw sample is already counted in the rollups."""
    value = conn.execute(
        select(tables.maintenance_state.c.value).where(
            tables.maintenance_state.c.key == WATERMARK_KEY
        )
    ).scalar_one_or_none()
    return float(value) if value is not None else 0.0


def run_once(store: Store, policy: RetentionPolicy, *, now_s: float) -> MaintenanceReport:
    """One maintenance pass: roll up, then expire. Safe to run concurrently with ingest."""
    with store.write() as conn:
        rolled = _roll_up(conn, policy.rollup_bucket_s, until_s=now_s - GRACE_S)
    expired = {}
    cutoff = now_s - policy.raw_retention_s
    for table in (tables.samples, tables.heartbeats, tables.coll_events):
        with store.write() as conn:
            expired[table.name] = conn.execute(
                delete(table).where(table.c.received_s < cutoff)
            ).rowcount
    if rolled or any(expired.values()):
        log.info("maintenance: rolled up %d samples, expired %s", rolled, expired)
    return MaintenanceReport(rolled_up=rolled, expired=expired)


def bucket_of(time_s: float, bucket_s: float) -> float:
    return math.floor(time_s / bucket_s) * bucket_s


def _roll_up(conn: Connection, bucket_s: float, *, until_s: float) -> int:
    since = watermark(conn)
    if until_s <= since:
        return 0
    s = tables.samples
    bucket = _floor(conn, s.c.time_s / bucket_s) * bucket_s
    query = (
        select(
            s.c.node,
            s.c.device,
            s.c.metric,
            bucket.label("bucket_s"),
            func.count().label("count"),
            func.sum(s.c.value).label("sum"),
            func.min(s.c.value).label("min"),
            func.max(s.c.value).label("max"),
        )
        .where(s.c.received_s >= since, s.c.received_s < until_s)
        .group_by(s.c.node, s.c.device, s.c.metric, bucket)
    )
    fresh = [dict(row) for row in conn.execute(query).mappings()]
    if fresh:
        _merge(conn, fresh)
    dialects.upsert(conn, tables.maintenance_state, [{"key": WATERMARK_KEY, "value": until_s}])
    return sum(int(row["count"]) for row in fresh)


def _floor(conn: Connection, expr: ColumnElement[Any]) -> ColumnElement[Any]:
    """floor() for non-negative values; SQLite builds may lack math functions, CAST truncates."""
    if conn.dialect.name == dialects.SQLITE:
        return cast(expr, BigInteger)
    return func.floor(expr)


def _merge(conn: Connection, fresh: list[dict[str, Any]]) -> None:
    """Add fresh bucket statistics to existing rollup rows (count/sum add, min/max combine)."""
    r = tables.sample_rollups
    keys = [(row["node"], row["device"], row["metric"], row["bucket_s"]) for row in fresh]
    existing: dict[tuple[Any, ...], Any] = {}
    for start in range(0, len(keys), 200):
        chunk = keys[start : start + 200]
        query = select(r).where(tuple_(r.c.node, r.c.device, r.c.metric, r.c.bucket_s).in_(chunk))
        for found in conn.execute(query).mappings():
            existing[(found["node"], found["device"], found["metric"], found["bucket_s"])] = found
    merged = []
    for key, row in zip(keys, fresh, strict=True):
        old: Any = existing.get(key)
        if old is not None:
            row = {
                **row,
                "count": old["count"] + row["count"],
                "sum": old["sum"] + row["sum"],
                "min": min(old["min"], row["min"]),
                "max": max(old["max"], row["max"]),
            }
        merged.append(row)
    dialects.upsert(conn, r, merged)
