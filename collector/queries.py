"""Read side of the store: jobs, ranks, step records, aggregates, findings and friends.

Each function takes an open connection and returns plain dicts/lists ready for JSON. Heatmaps live
in `heatmap`, samples in `samples`, trace export in `trace_export`. Must not write.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.engine import Connection

from vigil.collector import tables

MAX_ROWS = 100_000


def _rows(conn: Connection, query: Select[Any]) -> list[dict[str, Any]]:
    return [dict(row) for row in conn.execute(query).mappings()]


def list_jobs(conn: Connection, *, limit: int, offset: int) -> list[dict[str, Any]]:
    t = tables.jobs
    return _rows(
        conn, select(t).order_by(t.c.created_s.desc(), t.c.job_id).limit(limit).offset(offset)
    )


def world_sizes(conn: Connection, job_ids: list[str]) -> dict[str, int]:
    """Declared world sizes of `job_ids` (their Job record's, else their ranks' largest)."""
    found: dict[str, int] = {}
    for start in range(0, len(job_ids), 500):  # bounded IN lists
        chunk = job_ids[start : start + 500]
        ranks = tables.ranks
        query = (
            select(ranks.c.job_id, func.max(ranks.c.world_size))
            .where(ranks.c.job_id.in_(chunk))
            .group_by(ranks.c.job_id)
        )
        found.update({job: int(size) for job, size in conn.execute(query) if size})
        jobs = tables.jobs
        query = select(jobs.c.job_id, jobs.c.world_size).where(jobs.c.job_id.in_(chunk))
        found.update({job: int(size) for job, size in conn.execute(query) if size})
    return found


def get_job(conn: Connection, job_id: str) -> dict[str, Any] | None:
    rows = _rows(conn, select(tables.jobs).where(tables.jobs.c.job_id == job_id))
    return rows[0] if rows else None


def job_exists(conn: Connection, job_id: str) -> bool:
    """A job is known once its Job record or any of its step records arrived."""
    for t in (tables.jobs, tables.step_records, tables.ranks):
        if conn.execute(select(t.c.job_id).where(t.c.job_id == job_id).limit(1)).first():
            return True
    return False


def latest_heartbeats(conn: Connection, job_id: str) -> list[dict[str, Any]]:
    h = tables.heartbeats
    last = (
        select(func.max(h.c.id).label("id"))
        .where(h.c.job_id == job_id)
        .group_by(h.c.rank)
        .subquery()
    )
    query = (
        select(
            h.c.rank,
            h.c.time_s,
            h.c.state,
            h.c.last_step,
            h.c.last_group,
            h.c.last_seq,
            h.c.last_op,
        )
        .join(last, h.c.id == last.c.id)
        .order_by(h.c.rank)
    )
    return _rows(conn, query)


def job_state(conn: Connection, job_id: str, *, now_s: float) -> dict[str, Any]:
    """Where a job stands now: its state, progress, silent ranks and open findings."""
    job = get_job(conn, job_id)
    s = tables.step_records
    progress = conn.execute(
        select(func.max(s.c.step), func.max(s.c.end_s), func.count(func.distinct(s.c.rank))).where(
            s.c.job_id == job_id
        )
    ).one()
    f = tables.findings
    open_findings = conn.execute(
        select(func.count()).where(f.c.job_id == job_id, f.c.state == "open")
    ).scalar_one()
    beats = latest_heartbeats(conn, job_id)
    return {
        "job_id": job_id,
        "state": job["state"] if job else "unknown",
        "world_size": job["world_size"] if job else None,
        "last_step": progress[0],
        "last_step_end_s": progress[1],
        "num_ranks_reporting": progress[2],
        "open_findings": open_findings,
        "ranks": [{**b, "silent_s": max(0.0, now_s - b["time_s"])} for b in beats],
    }


def ranks(conn: Connection, job_id: str) -> list[dict[str, Any]]:
    r = tables.ranks
    return _rows(conn, select(r).where(r.c.job_id == job_id).order_by(r.c.rank))


def steps(
    conn: Connection,
    job_id: str,
    *,
    step_start: int,
    step_end: int,
    rank: int | None,
    limit: int,
) -> list[dict[str, Any]]:
    s = tables.step_records
    query = select(s).where(s.c.job_id == job_id, s.c.step.between(step_start, step_end))
    if rank is not None:
        query = query.where(s.c.rank == rank)
    return _rows(conn, query.order_by(s.c.step, s.c.rank).limit(min(limit, MAX_ROWS)))


def per_rank(
    conn: Connection, job_id: str, *, step_start: int, step_end: int
) -> list[dict[str, Any]]:
    """Per-rank aggregates over a step range: the table a straggler hunt starts from."""
    s = tables.step_records
    step_time = s.c.end_s - s.c.start_s
    compute = step_time - s.c.comm_wait_s
    query = (
        select(
            s.c.rank,
            func.count().label("num_steps"),
            func.avg(step_time).label("mean_step_time_s"),
            func.max(step_time).label("max_step_time_s"),
            func.avg(compute).label("mean_compute_s"),
            func.avg(s.c.comm_wait_s).label("mean_comm_wait_s"),
            func.avg(s.c.data_s).label("mean_data_s"),
            func.avg(s.c.mfu).label("mean_mfu"),
            func.sum(s.c.tokens).label("tokens"),
        )
        .where(s.c.job_id == job_id, s.c.step.between(step_start, step_end))
        .group_by(s.c.rank)
        .order_by(s.c.rank)
    )
    return [{**row, "tokens": int(row["tokens"] or 0)} for row in _rows(conn, query)]


def collectives(
    conn: Connection, job_id: str, *, step_start: int, step_end: int, by_rank: bool
) -> list[dict[str, Any]]:
    """Collective aggregates summed per (group, op), optionally per rank too."""
    c = tables.coll_aggs
    keys = [c.c.group_name.label("group"), c.c.op]
    if by_rank:
        keys.append(c.c.rank)
    query = (
        select(
            *keys,
            func.sum(c.c.count).label("count"),
            func.sum(c.c.bytes).label("bytes"),
            func.sum(c.c.total_device_s).label("total_device_s"),
            func.max(c.c.max_device_s).label("max_device_s"),
            func.sum(c.c.total_wait_s).label("total_wait_s"),
            func.count(func.distinct(c.c.step)).label("num_steps"),
        )
        .where(c.c.job_id == job_id, c.c.step.between(step_start, step_end))
        .group_by(*keys)
        .order_by(*keys)
    )
    return [
        {**row, "count": int(row["count"]), "bytes": int(row["bytes"])}
        for row in _rows(conn, query)
    ]


def findings(
    conn: Connection, *, job_id: str | None, state: str | None, kind: str | None, limit: int
) -> list[dict[str, Any]]:
    f = tables.findings
    query = select(f)
    for column, value in ((f.c.job_id, job_id), (f.c.state, state), (f.c.kind, kind)):
        if value is not None:
            query = query.where(column == value)
    return _rows(conn, query.order_by(f.c.detected_s.desc(), f.c.finding_id).limit(limit))


def actions(conn: Connection, *, job_id: str | None, limit: int) -> list[dict[str, Any]]:
    a = tables.actions
    query = select(a)
    if job_id is not None:
        query = query.where(a.c.job_id == job_id)
    return _rows(conn, query.order_by(a.c.start_s.desc(), a.c.action_id).limit(limit))


def checkpoints(conn: Connection, job_id: str, *, limit: int) -> list[dict[str, Any]]:
    c = tables.checkpoints
    query = select(c).where(c.c.job_id == job_id).order_by(c.c.step.desc(), c.c.location)
    return _rows(conn, query.limit(limit))


def diag_results(conn: Connection, *, node: str | None, limit: int) -> list[dict[str, Any]]:
    d = tables.diag_results
    query = select(d)
    if node is not None:
        query = query.where(d.c.node == node)
    rows = _rows(conn, query.order_by(d.c.time_s.desc(), d.c.id.desc()).limit(limit))
    for row in rows:
        row.pop("id")
    return rows


def last_step(conn: Connection, job_id: str) -> int | None:
    """The highest step the job reported (from the heat-map rows: one per step, not per rank)."""
    t = tables.step_matrix
    last = conn.execute(select(func.max(t.c.step)).where(t.c.job_id == job_id)).scalar_one()
    return None if last is None else int(last)
