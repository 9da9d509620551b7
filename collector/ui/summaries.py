"""What the web UI's pages show beyond the query API's rows: a jobs table with each job's
current figures, a job's figures over steps, its recovery timeline, a cell's drill-down and a
hang's last-sequence matrix.

Reads through the query layer (`queries`, `heatmap`, `samples`) and, where no query there fits
(one rank's collectives at one step, a node's sample metrics), small selects of its own. Every
read is bounded by steps, ranks or rows. Returns plain dicts for JSON. Must not write.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from vigil.collector import heatmap, queries, samples, tables

RECENT_STEPS = 20  # the jobs table's "current" figures: medians over the last 20 steps
MAX_JOBS = 500
MAX_SERIES_STEPS = 1000  # the job page's charts cover at most the last 1,000 steps
MAX_SERIES_CELLS = 2_000_000  # ... and fewer for large jobs (200 steps of 10,000 ranks)
MAX_TOKEN_STEPS = 300  # tokens/s sums step records, so over fewer steps
MAX_TOKEN_ROWS = 500_000  # ... and over at most this many records (50 steps of 10,000 ranks)
MAX_HANG_RANKS = 1024
SAMPLE_MARGIN_S = 30.0  # GPU samples this long before and after the chosen step


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """numpy's all-NaN warnings off: a step no rank reported is NaN, which is the answer."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _finite(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _recent_figures(conn: Connection, job_id: str, last: int) -> dict[str, Any]:
    window: dict[str, Any] = {
        "step_start": max(0, last - RECENT_STEPS + 1),
        "step_end": last,
        "max_steps": 10_000,
    }
    _, (_, _, times) = heatmap.matrix(
        conn, job_id, metric=heatmap.HeatmapMetric.STEP_TIME, **window
    )
    _, (_, _, mfu) = heatmap.matrix(conn, job_id, metric=heatmap.HeatmapMetric.MFU, **window)
    with _quiet():
        p50 = float(np.nanmedian(times)) if times.size else math.nan
        current_mfu = float(np.nanmean(mfu[-1])) if mfu.size else math.nan
    s = tables.step_records
    tokens = conn.execute(
        select(func.sum(s.c.tokens)).where(s.c.job_id == job_id, s.c.step == last)
    ).scalar_one()
    return {
        "last_step": last,
        "step_time_p50_s": _finite(p50),
        "mfu": _finite(current_mfu),
        "tokens_per_s": _finite(float(tokens or 0) / p50) if p50 and p50 > 0 else None,
    }


def _last_seen(conn: Connection, job_id: str, last: int | None) -> float | None:
    h = tables.heartbeats
    beat = conn.execute(select(func.max(h.c.time_s)).where(h.c.job_id == job_id)).scalar_one()
    seen = [float(beat)] if beat is not None else []
    if last is not None:
        s = tables.step_records
        end = conn.execute(
            select(func.max(s.c.end_s)).where(s.c.job_id == job_id, s.c.step == last)
        ).scalar_one()
        if end is not None:
            seen.append(float(end))
    return max(seen) if seen else None


def jobs(conn: Connection) -> list[dict[str, Any]]:
    """Every job (newest first) with its state, size, layout and current figures."""
    listed = queries.list_jobs(conn, limit=MAX_JOBS, offset=0)
    f = tables.findings
    open_counts: dict[str, int] = dict(
        conn.execute(
            select(f.c.job_id, func.count()).where(f.c.state == "open").group_by(f.c.job_id)
        ).all()
    )
    out = []
    for job in listed:
        job_id = job["job_id"]
        last = queries.last_step(conn, job_id)
        figures = _recent_figures(conn, job_id, last) if last is not None else {}
        out.append(
            {
                "job_id": job_id,
                "name": job["name"],
                "state": job["state"],
                "world_size": job["world_size"],
                "layout": job["layout"] or {},
                "device_kind": job["device_kind"],
                "created_s": job["created_s"],
                "open_findings": int(open_counts.get(job_id, 0)),
                "last_seen_s": _last_seen(conn, job_id, last),
                "last_step": figures.get("last_step"),
                "mfu": figures.get("mfu"),
                "step_time_p50_s": figures.get("step_time_p50_s"),
                "tokens_per_s": figures.get("tokens_per_s"),
            }
        )
    return out


def series(
    conn: Connection, job_id: str, *, step_start: int | None, step_end: int | None
) -> dict[str, Any]:
    """Per step: step time p50 and p99 over ranks, mean MFU, tokens per second."""
    last = queries.last_step(conn, job_id)
    if last is None:
        return {
            "steps": [],
            "step_time_p50_s": [],
            "step_time_p99_s": [],
            "mfu": [],
            "tokens_per_s": [],
        }
    end = min(last, step_end) if step_end is not None else last
    job = queries.get_job(conn, job_id) or {}
    width = min(MAX_SERIES_STEPS, max(50, MAX_SERIES_CELLS // max(1, job.get("world_size") or 1)))
    start = max(step_start or 0, end - width + 1)
    window: dict[str, Any] = {"step_start": start, "step_end": end, "max_steps": MAX_SERIES_STEPS}
    _, (steps, _, times) = heatmap.matrix(
        conn, job_id, metric=heatmap.HeatmapMetric.STEP_TIME, **window
    )
    _, (mfu_steps, _, mfu) = heatmap.matrix(
        conn, job_id, metric=heatmap.HeatmapMetric.MFU, **window
    )
    with _quiet():
        p50 = np.nanmedian(times, axis=1) if times.size else np.zeros(0)
        p99 = np.nanpercentile(times, 99, axis=1) if times.size else np.zeros(0)
        mean_mfu = np.nanmean(mfu, axis=1) if mfu.size else np.zeros(0)
    s = tables.step_records
    token_steps = min(
        MAX_TOKEN_STEPS, max(20, MAX_TOKEN_ROWS // max(1, job.get("world_size") or 1))
    )
    token_start = max(start, end - token_steps + 1)
    tokens = dict(
        conn.execute(
            select(s.c.step, func.sum(s.c.tokens))
            .where(s.c.job_id == job_id, s.c.step.between(token_start, end))
            .group_by(s.c.step)
        ).all()
    )
    mfu_of = dict(zip(mfu_steps.tolist(), mean_mfu.tolist(), strict=True))
    step_list = steps.tolist()
    rates = [
        _finite(float(tokens[step]) / t) if step in tokens and t > 0 else None
        for step, t in zip(step_list, p50.tolist(), strict=True)
    ]
    return {
        "steps": step_list,
        "step_time_p50_s": [_finite(v) for v in p50.tolist()],
        "step_time_p99_s": [_finite(v) for v in p99.tolist()],
        "mfu": [_finite(mfu_of.get(step, math.nan)) for step in step_list],
        "tokens_per_s": rates,
    }


def recovery(conn: Connection, job_id: str) -> list[dict[str, Any]]:
    """Per finding (oldest first): detected, its actions in order, and when training resumed,
    the time to recover and the steps lost (from the record of the action that relaunched it:
    a restart, migration or resize)."""
    found = queries.findings(conn, job_id=job_id, state=None, kind=None, limit=200)
    acts = queries.actions(conn, job_id=job_id, limit=1000)
    by_finding: dict[str, list[dict[str, Any]]] = {}
    for action in sorted(acts, key=lambda a: a["start_s"]):
        by_finding.setdefault(action["finding_id"], []).append(action)
    out = []
    for finding in sorted(found, key=lambda f: f["detected_s"]):
        mine = by_finding.get(finding["finding_id"], [])
        if not mine:
            continue
        # The action that relaunched the job (restart, migrate, resize) carries its recovery.
        restarts = [a for a in mine if (a.get("recovered_s") or 0) > 0]
        restart = restarts[-1] if restarts else None
        resumed_s = float(restart["recovered_s"]) if restart else None
        out.append(
            {
                "finding_id": finding["finding_id"],
                "kind": finding["kind"],
                "summary": finding["summary"],
                "detected_s": finding["detected_s"],
                "actions": mine,
                "resumed_s": resumed_s,
                "time_to_recover_s": resumed_s - finding["detected_s"] if resumed_s else None,
                "resume_step": _known(restart, "resume_step"),
                "steps_lost": _known(restart, "steps_lost"),
            }
        )
    return out


def _known(action: dict[str, Any] | None, key: str) -> int | None:
    value = (action or {}).get(key, -1)
    return int(value) if value is not None and value >= 0 else None


def state(conn: Connection, job_id: str, *, now_s: float) -> dict[str, Any]:
    """`queries.job_state`'s figures read from the last step alone (its count of distinct
    reporting ranks scans every step record: seconds for a 10,000-rank job's 10 M rows)."""
    job = queries.get_job(conn, job_id)
    last = queries.last_step(conn, job_id)
    s, f = tables.step_records, tables.findings
    end_s, reporting = None, 0
    if last is not None:
        end_s, reporting = conn.execute(
            select(func.max(s.c.end_s), func.count()).where(s.c.job_id == job_id, s.c.step == last)
        ).one()
    open_findings = conn.execute(
        select(func.count()).where(f.c.job_id == job_id, f.c.state == "open")
    ).scalar_one()
    beats = queries.latest_heartbeats(conn, job_id)
    return {
        "job_id": job_id,
        "state": job["state"] if job else "unknown",
        "world_size": job["world_size"] if job else None,
        "last_step": last,
        "last_step_end_s": end_s,
        "num_ranks_reporting": int(reporting),
        "open_findings": int(open_findings),
        "ranks": [{**b, "silent_s": max(0.0, now_s - b["time_s"])} for b in beats[:MAX_HANG_RANKS]],
    }


def overview(conn: Connection, job_id: str, *, now_s: float) -> dict[str, Any]:
    return {
        "job": queries.get_job(conn, job_id),
        "state": state(conn, job_id, now_s=now_s),
        "findings": queries.findings(conn, job_id=job_id, state=None, kind=None, limit=200),
        "recovery": recovery(conn, job_id),
        "checkpoints": queries.checkpoints(conn, job_id, limit=50),
    }


def _rank_collectives(conn: Connection, job_id: str, rank: int, step: int) -> list[dict[str, Any]]:
    c = tables.coll_aggs
    query = (
        select(
            c.c.group_name.label("group"),
            c.c.op,
            func.sum(c.c.count).label("count"),
            func.sum(c.c.bytes).label("bytes"),
            func.sum(c.c.total_device_s).label("total_device_s"),
            func.max(c.c.max_device_s).label("max_device_s"),
            func.sum(c.c.total_wait_s).label("total_wait_s"),
            func.max(c.c.last_seq).label("last_seq"),
        )
        .where(c.c.job_id == job_id, c.c.step == step, c.c.rank == rank)
        .group_by(c.c.group_name, c.c.op)
        .order_by(c.c.group_name, c.c.op)
    )
    # PostgreSQL sums integers as numeric: back to int and float for JSON.
    return [
        {
            **row,
            **{k: int(row[k]) for k in ("count", "bytes", "last_seq")},
            **{k: float(row[k]) for k in ("total_device_s", "max_device_s", "total_wait_s")},
        }
        for row in conn.execute(query).mappings()
    ]


def _median_rank(conn: Connection, job_id: str, step: int, rank: int) -> int | None:
    """The rank whose compute time (step time minus exposed wait) at `step` is nearest the
    step's median, other than `rank` when there is another: in synchronous training every
    rank's step time is about the same, compute tells the typical rank from a straggler."""
    one: dict[str, Any] = {"step_start": step, "step_end": step, "max_steps": 1}
    _, (_, ranks, total) = heatmap.matrix(
        conn, job_id, metric=heatmap.HeatmapMetric.STEP_TIME, **one
    )
    _, (_, _, wait) = heatmap.matrix(conn, job_id, metric=heatmap.HeatmapMetric.COMM_WAIT, **one)
    if not total.size or np.isnan(total[0]).all():
        return None
    compute = total[0] - wait[0]
    with _quiet():
        distance = np.abs(compute - np.nanmedian(compute))
        if len(ranks) > 1:
            distance[ranks == rank] = np.nan
        if np.isnan(distance).all():
            return None
        return int(ranks[int(np.nanargmin(distance))])


def _step_record(conn: Connection, job_id: str, rank: int, step: int) -> dict[str, Any] | None:
    rows = queries.steps(conn, job_id, step_start=step, step_end=step, rank=rank, limit=1)
    return rows[0] if rows else None


def _gpu_samples(conn: Connection, node: str, start_s: float, end_s: float) -> list[dict[str, Any]]:
    s = tables.samples
    metrics = [
        m
        for (m,) in conn.execute(
            select(s.c.metric)
            .where(s.c.node == node, s.c.time_s.between(start_s, end_s))
            .group_by(s.c.metric)
            .order_by(s.c.metric)
            .limit(12)
        )
    ]
    out = []
    for metric in metrics:
        query = samples.SampleQuery(
            metric=metric, start_s=start_s, end_s=end_s, points=60, node=node
        )
        out.append(samples.series(conn, query, rollup_bucket_s=math.inf))
    return out


def cell(conn: Connection, job_id: str, *, rank: int, step: int) -> dict[str, Any]:
    """One rank at one step beside the step's median rank: phases, collectives, GPU samples."""
    median = _median_rank(conn, job_id, step, rank)
    where = {r["rank"]: r for r in queries.ranks(conn, job_id) if r["rank"] in (rank, median)}
    record = _step_record(conn, job_id, rank, step)
    gpu: list[dict[str, Any]] = []
    node = where.get(rank, {}).get("node")
    if node and record:
        gpu = _gpu_samples(
            conn, node, record["start_s"] - SAMPLE_MARGIN_S, record["end_s"] + SAMPLE_MARGIN_S
        )
    return {
        "rank": rank,
        "step": step,
        "where": where.get(rank),
        "record": record,
        "collectives": _rank_collectives(conn, job_id, rank, step),
        "median_rank": median,
        "median_record": _step_record(conn, job_id, median, step) if median is not None else None,
        "median_collectives": _rank_collectives(conn, job_id, median, step)
        if median is not None
        else [],
        "gpu_samples": gpu,
    }


def hang(conn: Connection, job_id: str) -> dict[str, Any]:
    """Rank x group last sequence numbers (who is behind) and the hang findings' stack groups."""
    beats = queries.latest_heartbeats(conn, job_id)[:MAX_HANG_RANKS]
    last = queries.last_step(conn, job_id)
    c = tables.coll_aggs
    seqs: dict[tuple[int, str], int] = {}
    if last is not None:
        query = (
            select(c.c.rank, c.c.group_name, func.max(c.c.last_seq))
            .where(c.c.job_id == job_id, c.c.step >= last - 2, c.c.rank < MAX_HANG_RANKS)
            .group_by(c.c.rank, c.c.group_name)
        )
        seqs = {(int(r), str(g)): int(q) for r, g, q in conn.execute(query)}
    for beat in beats:
        if beat["last_group"]:
            key = (int(beat["rank"]), str(beat["last_group"]))
            seqs[key] = max(seqs.get(key, -1), int(beat["last_seq"]))
    groups = sorted({g for _, g in seqs})
    ranks = sorted({r for r, _ in seqs} | {int(b["rank"]) for b in beats})
    matrix = [[seqs.get((r, g)) for g in groups] for r in ranks]
    hangs = queries.findings(conn, job_id=job_id, state=None, kind="hang", limit=10)
    stacks = [
        {"finding_id": f["finding_id"], "ranks": e.get("observed"), "note": e.get("note", "")}
        for f in hangs
        for e in f["evidence"]
        if e.get("metric") == "stack_group_ranks"
    ]
    return {
        "groups": groups,
        "ranks": ranks,
        "last_seq": matrix,
        "heartbeats": beats,
        "hang_findings": hangs,
        "stacks": stacks,
    }
