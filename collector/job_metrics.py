"""Job-level series computed from the store at scrape time, cached (a prometheus-client Collector).

What only the collector knows: findings and actions by kind and state, restarts, time to recover,
steps lost, goodput, nodes excluded by recovery, whether a job is running, and the last step's
data-loader wait, collective time per (group kind, op) and checkpoint stall. Every series is per
job (never per rank), for at most `max_jobs` of the most recently created jobs, and each job
costs a handful of index seeks plus one step's rows; the result is kept `cache_s` seconds, so
several Prometheus servers scraping at once cost one refresh. Read-only: never writes the store.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, func, select

from vigil.collector import tables
from vigil.metric_names import MetricKind, Unit, metric_name

log = logging.getLogger(__name__)

# Actions that start a new attempt of the job (recovery/policy.py's RESTARTING).
RESTARTING = ("restart", "migrate", "resize")
# Actions that take a node out of a job's placement.
EXCLUDING = ("cordon", "migrate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobMetricsConfig:
    # A few seconds: Prometheus scrapes every 15-30 s; two servers (HA pair) share one refresh.
    cache_s: float = 5.0
    # Jobs followed: the newest by creation. 256 keeps a refresh under ~1,000 index seeks.
    max_jobs: int = 256
    # A job is running while its rank 0 heartbeat (sent each second) is at most this old.
    live_s: float = 60.0

    def __post_init__(self) -> None:
        if self.cache_s < 0:
            raise ValueError(f"cache_s must be >= 0, got {self.cache_s}")
        if self.max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {self.max_jobs}")
        if self.live_s <= 0:
            raise ValueError(f"live_s must be > 0, got {self.live_s}")


def _name(name: str, unit: Unit = Unit.NONE, kind: MetricKind = MetricKind.GAUGE) -> str:
    return metric_name("collector", name, unit, kind)


@dataclasses.dataclass
class _Job:
    job_id: str
    running: bool = False
    last_step: int = -1
    step_time_s: float = 0.0
    data_wait: tuple[float, float] | None = None
    collectives: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    checkpoint_blocked_s: float | None = None
    wall_s: float = 0.0


class JobMetrics(Collector):
    """Scrape-time collector over the store; `read` yields a SQLAlchemy connection."""

    def __init__(
        self,
        read: Callable[[], AbstractContextManager[Connection]],
        *,
        config: JobMetricsConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._read = read
        self._config = config or JobMetricsConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._cached_at = -float("inf")
        self._errors = 0
        self._refresh_s = 0.0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = time.monotonic()
            if now - self._cached_at >= self._config.cache_s:
                started = time.perf_counter()
                try:
                    self._cached = self._families()
                except Exception:  # a store hiccup must not break the whole /metrics page
                    self._errors += 1
                    log.exception("job metrics: reading the store failed; serving the last ones")
                self._refresh_s = time.perf_counter() - started
                self._cached_at = now
            families = list(self._cached)
            errors, refresh_s = self._errors, self._refresh_s
        yield from families
        failed = CounterMetricFamily(
            _name("job_metrics_errors", kind=MetricKind.COUNTER),
            "Refreshes of the store-derived job metrics that failed (the last good ones served).",
        )
        failed.add_metric([], errors)
        yield failed
        took = GaugeMetricFamily(
            _name("job_metrics_refresh", Unit.SECONDS),
            "Seconds the last refresh of the store-derived job metrics took.",
        )
        took.add_metric([], refresh_s)
        yield took

    def _families(self) -> list[Metric]:
        now_s = self._clock()
        with self._read() as conn:
            job_ids = _recent_jobs(conn, self._config.max_jobs)
            jobs = [_job(conn, job_id, now_s, self._config.live_s) for job_id in job_ids]
            counts = _counts(conn, tables.findings, job_ids)
            actions = _counts(conn, tables.actions, job_ids)
            restarts = _restarts(conn, job_ids)
            excluded = _excluded(conn, job_ids)
        return _render(jobs, counts, actions, restarts, excluded)


def _recent_jobs(conn: Connection, limit: int) -> list[str]:
    j = tables.jobs
    query = select(j.c.job_id).order_by(j.c.created_s.desc(), j.c.job_id).limit(limit)
    return [row[0] for row in conn.execute(query)]


def _job(conn: Connection, job_id: str, now_s: float, live_s: float) -> _Job:
    job = _Job(job_id)
    h, s = tables.heartbeats, tables.step_records
    beat = conn.execute(
        select(func.max(h.c.time_s)).where(h.c.job_id == job_id, h.c.rank == 0)
    ).scalar()
    job.running = beat is not None and now_s - float(beat) <= live_s
    last = conn.execute(select(func.max(s.c.step)).where(s.c.job_id == job_id)).scalar()
    if last is None:
        return job
    job.last_step = int(last)
    rows = conn.execute(
        select(s.c.rank, s.c.start_s, s.c.end_s, s.c.data_s).where(
            s.c.job_id == job_id, s.c.step == job.last_step
        )
    ).all()
    if rows:
        job.step_time_s = statistics.median(r.end_s - r.start_s for r in rows)
        data = [float(r.data_s) for r in rows]
        job.data_wait = (statistics.median(data), max(data))
        first = conn.execute(select(func.min(s.c.step)).where(s.c.job_id == job_id)).scalar()
        began = conn.execute(
            select(func.min(s.c.start_s)).where(s.c.job_id == job_id, s.c.step == first)
        ).scalar()
        if began is not None:
            job.wall_s = max(0.0, max(r.end_s for r in rows) - float(began))
    job.collectives = _collectives(conn, job_id, job.last_step)
    c = tables.checkpoints
    blocked = conn.execute(
        select(c.c.blocked_s).where(c.c.job_id == job_id).order_by(c.c.step.desc()).limit(1)
    ).scalar()
    job.checkpoint_blocked_s = None if blocked is None else float(blocked)
    return job


def group_kind(group: str) -> str:
    """`tp:3` -> `tp`, `pp:p2p:0-1` -> `pp:p2p`, `world` -> `world`: a label bounded per job."""
    head, sep, tail = group.rpartition(":")
    if not sep:
        return group
    return head if tail.replace("-", "").isdigit() else group


def _collectives(conn: Connection, job_id: str, step: int) -> dict[tuple[str, str], float]:
    """Median over ranks of each rank's collective seconds per (group kind, op) in `step`."""
    a = tables.coll_aggs
    rows = conn.execute(
        select(a.c.rank, a.c.group_name, a.c.op, a.c.total_device_s).where(
            a.c.job_id == job_id, a.c.step == step
        )
    ).all()
    per_rank: dict[tuple[str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        per_rank[(group_kind(row.group_name), row.op)][int(row.rank)] += float(row.total_device_s)
    return {key: statistics.median(ranks.values()) for key, ranks in per_rank.items()}


def _counts(conn: Connection, table: Any, job_ids: list[str]) -> list[tuple[str, str, str, int]]:
    if not job_ids:
        return []
    query = (
        select(table.c.job_id, table.c.kind, table.c.state, func.count())
        .where(table.c.job_id.in_(job_ids))
        .group_by(table.c.job_id, table.c.kind, table.c.state)
    )
    return [(r[0], r[1], r[2], int(r[3])) for r in conn.execute(query)]


@dataclasses.dataclass
class _Restarts:
    count: int = 0
    steps_lost: int = 0
    last_recovery_s: float | None = None
    recovery_total_s: float = 0.0


def _restarts(conn: Connection, job_ids: list[str]) -> dict[str, _Restarts]:
    """Succeeded restarting actions per job: time to recover = recovered_s - finding detected_s."""
    if not job_ids:
        return {}
    a, f = tables.actions, tables.findings
    query = (
        select(a.c.job_id, a.c.steps_lost, a.c.recovered_s, a.c.end_s, f.c.detected_s)
        .select_from(a.outerjoin(f, a.c.finding_id == f.c.finding_id))
        .where(a.c.job_id.in_(job_ids), a.c.kind.in_(RESTARTING), a.c.state == "succeeded")
        .order_by(a.c.end_s)
    )
    out: dict[str, _Restarts] = defaultdict(_Restarts)
    for row in conn.execute(query):
        r = out[row.job_id]
        r.count += 1
        r.steps_lost += max(0, int(row.steps_lost))
        if row.recovered_s and row.detected_s:
            seconds = max(0.0, float(row.recovered_s) - float(row.detected_s))
            r.last_recovery_s = seconds
            r.recovery_total_s += seconds
    return out


def _excluded(conn: Connection, job_ids: list[str]) -> dict[str, int]:
    if not job_ids:
        return {}
    a = tables.actions
    query = (
        select(a.c.job_id, func.count(func.distinct(a.c.target)))
        .where(a.c.job_id.in_(job_ids), a.c.kind.in_(EXCLUDING), a.c.state == "succeeded")
        .group_by(a.c.job_id)
    )
    return {r[0]: int(r[1]) for r in conn.execute(query)}


def goodput(job: _Job, restarts: _Restarts | None) -> float | None:
    """Share of the job's wall time (first step's start to last step's end) not lost to faults:
    1 - (time to recover + steps lost x median step time) / wall time; None before two steps."""
    if job.wall_s <= 0:
        return None
    lost = 0.0
    if restarts is not None:
        lost = restarts.recovery_total_s + restarts.steps_lost * job.step_time_s
    return min(1.0, max(0.0, 1.0 - lost / job.wall_s))


def _gauge(name: str, unit: Unit, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(_name(name, unit), doc, labels=labels)


def _render(
    jobs: list[_Job],
    findings: list[tuple[str, str, str, int]],
    actions: list[tuple[str, str, str, int]],
    restarts: dict[str, _Restarts],
    excluded: dict[str, int],
) -> list[Metric]:
    job = ["job_id"]
    running = _gauge("job_running", Unit.NONE, "1 while the job's rank 0 heartbeats.", job)
    last_step = _gauge("job_last_step", Unit.NONE, "The newest step any rank reported.", job)
    data = _gauge(
        "job_data_wait",
        Unit.SECONDS,
        "Data-loader wait in the job's newest step across ranks (stat: median, max).",
        [*job, "stat"],
    )
    coll = _gauge(
        "job_collective",
        Unit.SECONDS,
        "Median over ranks of collective seconds in the newest step, per (group kind, op).",
        [*job, "group", "op"],
    )
    ckpt = _gauge(
        "checkpoint_blocked",
        Unit.SECONDS,
        "Seconds training was blocked by the job's newest checkpoint.",
        job,
    )
    good = _gauge(
        "job_goodput",
        Unit.RATIO,
        "Share of the job's wall time not lost to recoveries (time to recover, steps lost).",
        job,
    )
    for j in jobs:
        running.add_metric([j.job_id], 1.0 if j.running else 0.0)
        if j.last_step >= 0:
            last_step.add_metric([j.job_id], j.last_step)
        if j.data_wait is not None:
            data.add_metric([j.job_id, "median"], j.data_wait[0])
            data.add_metric([j.job_id, "max"], j.data_wait[1])
        for (group, op), seconds in sorted(j.collectives.items()):
            coll.add_metric([j.job_id, group, op], seconds)
        if j.checkpoint_blocked_s is not None:
            ckpt.add_metric([j.job_id], j.checkpoint_blocked_s)
        value = goodput(j, restarts.get(j.job_id))
        if value is not None:
            good.add_metric([j.job_id], value)
    families: list[Metric] = [running, last_step, data, coll, ckpt, good]
    for name, doc, rows in (
        ("findings", "Findings in the store by job, kind and state.", findings),
        ("actions", "Recovery actions in the store by job, kind and state.", actions),
    ):
        family = _gauge(name, Unit.NONE, doc, ["job_id", "kind", "state"])
        for job_id, kind, state, count in rows:
            family.add_metric([job_id, kind, state], count)
        families.append(family)
    families += _restart_families([j.job_id for j in jobs], restarts, excluded)
    return families


def _restart_families(
    job_ids: list[str], restarts: dict[str, _Restarts], excluded: dict[str, int]
) -> list[Metric]:
    """Restarts, steps lost and nodes excluded for every job followed (0 when none)."""
    job = ["job_id"]
    count = _gauge("job_restarts", Unit.NONE, "Succeeded restarts (restart, migrate, resize).", job)
    lost = _gauge("job_steps_lost", Unit.NONE, "Steps trained again after restarts, summed.", job)
    last = _gauge(
        "job_time_to_recover",
        Unit.SECONDS,
        "The newest recovered restart's time to recover: first step seen - finding detected.",
        job,
    )
    nodes = _gauge("job_nodes_excluded", Unit.NONE, "Nodes recovery cordoned or moved off.", job)
    for job_id in job_ids:
        r = restarts.get(job_id) or _Restarts()
        count.add_metric([job_id], r.count)
        lost.add_metric([job_id], r.steps_lost)
        nodes.add_metric([job_id], excluded.get(job_id, 0))
        if r.last_recovery_s is not None:
            last.add_metric([job_id], r.last_recovery_s)
    return [count, lost, last, nodes]
