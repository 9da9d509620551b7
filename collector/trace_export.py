"""Exports a step window of one job as Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

One process per rank; thread 1 holds steps, thread 2 their phases, thread 3 the collective events
shipped for the window. Timestamps are microseconds from the window's first step start (kept in
`otherData.origin_s`), so doubles keep sub-microsecond precision. The SDK records phase durations,
not phase start times: phases are laid out back to back from the step start and say so. Must not
write.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from vigil.collector import tables

# A window larger than this is refused: Perfetto's UI struggles past a few hundred MB of JSON.
MAX_STEP_ROWS = 200_000
STEP_TID, PHASE_TID, COLLECTIVE_TID = 1, 2, 3
PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_wait_s")


class WindowTooLargeError(ValueError):
    """The requested window holds more step records than one export may carry."""


def chrome_trace(
    conn: Connection, job_id: str, *, step_start: int, step_end: int
) -> dict[str, Any]:
    s = tables.step_records
    in_window = (s.c.job_id == job_id, s.c.step.between(step_start, step_end))
    count = conn.execute(select(func.count()).where(*in_window)).scalar_one()
    if count > MAX_STEP_ROWS:
        raise WindowTooLargeError(
            f"steps {step_start}..{step_end} hold {count} step records, more than the "
            f"{MAX_STEP_ROWS} one export may carry: ask for a narrower step range"
        )
    steps = [
        dict(r)
        for r in conn.execute(select(s).where(*in_window).order_by(s.c.rank, s.c.step)).mappings()
    ]
    origin = min((r["start_s"] for r in steps), default=0.0)
    events: list[dict[str, Any]] = []
    nodes = _node_names(conn, job_id)
    for rank in sorted({r["rank"] for r in steps}):
        events.extend(_metadata(rank, nodes.get(rank, "")))
    for row in steps:
        events.extend(_step_events(row, origin))
    events.extend(_collective_events(conn, job_id, step_start, step_end, origin))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "job_id": job_id,
            "step_start": step_start,
            "step_end": step_end,
            "origin_s": origin,
            "exporter": "vigil collector",
            "phase_layout": "phases are placed back to back from the step start",
        },
    }


def _node_names(conn: Connection, job_id: str) -> dict[int, str]:
    r = tables.ranks
    rows = conn.execute(select(r.c.rank, r.c.node).where(r.c.job_id == job_id))
    return {int(rank): str(node) for rank, node in rows}


def _metadata(rank: int, node: str) -> list[dict[str, Any]]:
    label = f"rank {rank}" + (f" ({node})" if node else "")
    meta = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}}]
    meta.append(
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": rank,
            "tid": 0,
            "args": {"sort_index": rank},
        }
    )
    for tid, name in ((STEP_TID, "steps"), (PHASE_TID, "phases"), (COLLECTIVE_TID, "collectives")):
        meta.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
        )
    return meta


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _step_events(row: dict[str, Any], origin: float) -> list[dict[str, Any]]:
    rank, start, end = row["rank"], row["start_s"], row["end_s"]
    args = {k: row[k] for k in ("tokens", "mfu", "loss", "comm_wait_s", "peak_memory_bytes")}
    events = [
        {
            "ph": "X",
            "name": f"step {row['step']}",
            "cat": "step",
            "pid": rank,
            "tid": STEP_TID,
            "ts": _us(start - origin),
            "dur": _us(end - start),
            "args": args,
        }
    ]
    cursor = start
    for phase in PHASES:
        length = min(row[phase], max(0.0, end - cursor))
        if length > 0:
            name = phase.removesuffix("_s").replace("comm_wait", "exposed comm wait")
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": "phase",
                    "pid": rank,
                    "tid": PHASE_TID,
                    "ts": _us(cursor - origin),
                    "dur": _us(length),
                    "args": {"step": row["step"], "seconds": row[phase]},
                }
            )
            cursor += length
    return events


def _collective_events(
    conn: Connection, job_id: str, step_start: int, step_end: int, origin: float
) -> list[dict[str, Any]]:
    c = tables.coll_events
    query = (
        select(c)
        .where(c.c.job_id == job_id, c.c.step.between(step_start, step_end), c.c.start_s > 0)
        .order_by(c.c.rank, c.c.seq)
        .limit(MAX_STEP_ROWS)
    )
    return [
        {
            "ph": "X",
            "name": row["op"],
            "cat": "collective",
            "pid": row["rank"],
            "tid": COLLECTIVE_TID,
            "ts": _us(row["start_s"] - origin),
            "dur": _us(max(0.0, row["end_s"] - row["start_s"])),
            "args": {k: row[k] for k in ("group_name", "seq", "bytes", "dtype", "step")},
        }
        for row in conn.execute(query).mappings()
    ]
