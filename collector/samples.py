"""Sample series downsampled to the requested range: at most `points` buckets per series.

Buckets narrower than the rollup bucket read raw samples; wider ones read the rollups (which still
hold what retention expired) plus the raw samples received after the rollup watermark. Must not
write.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Select, cast, func, select
from sqlalchemy.engine import Connection

from vigil.collector import dialects, retention, tables


@dataclass(frozen=True, kw_only=True)
class SampleQuery:
    metric: str
    start_s: float
    end_s: float
    points: int
    node: str | None = None
    device: str | None = None
    job_id: str | None = None

    def __post_init__(self) -> None:
        if not self.end_s > self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")
        if self.points < 1:
            raise ValueError(f"points must be >= 1, got {self.points}")

    @property
    def width_s(self) -> float:
        return (self.end_s - self.start_s) / self.points


class _Bucket:
    __slots__ = ("count", "max", "min", "sum")

    def __init__(self) -> None:
        self.count, self.sum, self.min, self.max = 0, 0.0, float("inf"), float("-inf")

    def add(self, count: int, total: float, low: float, high: float) -> None:
        self.count += count
        self.sum += total
        self.min = min(self.min, low)
        self.max = max(self.max, high)


def series(conn: Connection, query: SampleQuery, *, rollup_bucket_s: float) -> dict[str, Any]:
    """Series per (node, device) of `query.metric`, each a list of bucket statistics."""
    buckets: dict[tuple[str, str], dict[int, _Bucket]] = defaultdict(dict)
    use_rollups = query.width_s >= rollup_bucket_s and query.job_id is None
    since = retention.watermark(conn) if use_rollups else None
    sources = [_raw(conn, query, received_since=since)]
    if use_rollups:
        sources.append(_rollups(conn, query))
    for source in sources:
        for node, device, index, count, total, low, high in conn.execute(source):
            if 0 <= index < query.points:
                bucket = buckets[(node, device)].setdefault(int(index), _Bucket())
                bucket.add(int(count), float(total), float(low), float(high))
    return {
        "metric": query.metric,
        "start_s": query.start_s,
        "end_s": query.end_s,
        "bucket_s": query.width_s,
        "source": "rollup" if use_rollups else "raw",
        "series": [
            {
                "node": node,
                "device": device,
                "points": [
                    {
                        "time_s": query.start_s + i * query.width_s,
                        "mean": b.sum / b.count,
                        "min": b.min,
                        "max": b.max,
                        "count": b.count,
                    }
                    for i, b in sorted(points.items())
                ],
            }
            for (node, device), points in sorted(buckets.items())
        ],
    }


def _index(conn: Connection, time: Any, query: SampleQuery) -> Any:
    offset = (time - query.start_s) / query.width_s
    if conn.dialect.name == dialects.SQLITE:
        return cast(offset, BigInteger)  # truncation is floor for non-negative offsets
    return func.floor(offset)


def _raw(conn: Connection, query: SampleQuery, *, received_since: float | None) -> Select[Any]:
    s = tables.samples
    index = _index(conn, s.c.time_s, query)
    stmt = select(
        s.c.node,
        s.c.device,
        index,
        func.count(),
        func.sum(s.c.value),
        func.min(s.c.value),
        func.max(s.c.value),
    ).where(s.c.metric == query.metric, s.c.time_s >= query.start_s, s.c.time_s < query.end_s)
    for column, value in (
        (s.c.node, query.node),
        (s.c.device, query.device),
        (s.c.job_id, query.job_id),
    ):
        if value is not None:
            stmt = stmt.where(column == value)
    if received_since is not None:
        stmt = stmt.where(s.c.received_s >= received_since)
    return stmt.group_by(s.c.node, s.c.device, index)


def _rollups(conn: Connection, query: SampleQuery) -> Select[Any]:
    r = tables.sample_rollups
    index = _index(conn, r.c.bucket_s, query)
    stmt = select(
        r.c.node,
        r.c.device,
        index,
        func.sum(r.c["count"]),
        func.sum(r.c["sum"]),
        func.min(r.c["min"]),
        func.max(r.c["max"]),
    ).where(r.c.metric == query.metric, r.c.bucket_s >= query.start_s, r.c.bucket_s < query.end_s)
    for column, value in ((r.c.node, query.node), (r.c.device, query.device)):
        if value is not None:
            stmt = stmt.where(column == value)
    return stmt.group_by(r.c.node, r.c.device, index)
