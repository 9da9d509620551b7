"""Rank-major step matrices: per (job, step) one float64 array per heatmap metric.

A rank x step heatmap of a 1,024-rank job over 1,000 steps is a million cells; reading them as a
million rows costs seconds, reading 1,000 rows of packed arrays costs milliseconds. Ingest patches
the cells of the ranks a batch carries (a re-run step overwrites its cells, like step_records).
Pure packing helpers plus the two SQL round trips; must not commit.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import bindparam, select, tuple_, update
from sqlalchemy.engine import Connection

from vigil import schema
from vigil.collector import dialects, tables

METRICS = ("step_time", "comm_wait", "mfu")
NAN = math.nan


def pack(values: array[float]) -> bytes:
    """Little-endian float64 bytes (the stored layout on every platform)."""
    if sys.byteorder == "big":
        values = array("d", values)
        values.byteswap()
    return values.tobytes()


def unpack(blob: bytes) -> array[float]:
    values = array("d")
    values.frombytes(blob)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def patch(blob: bytes | None, cells: Iterable[tuple[int, float]]) -> bytes:
    """Set `rank -> value` cells in a packed array, growing it with NaN (missing) as needed."""
    values = unpack(blob) if blob else array("d")
    for rank, value in cells:
        if rank >= len(values):
            values.extend([NAN] * (rank + 1 - len(values)))
        values[rank] = value
    return pack(values)


def _cells(records: Sequence[schema.StepRecord]) -> dict[tuple[str, int], list[tuple[int, ...]]]:
    grouped: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for r in records:
        grouped[(r.job_id, r.step)].append((r.rank, r.end_s - r.start_s, r.comm_wait_s, r.mfu))
    return grouped


def write(conn: Connection, records: Sequence[schema.StepRecord]) -> None:
    """Patch the matrices of every (job, step) in `records` inside the caller's transaction."""
    grouped = _cells(records)
    if not grouped:
        return
    keys = sorted(grouped)
    t = tables.step_matrix
    empty = {m: b"" for m in METRICS}
    # Create missing rows first so that, on PostgreSQL, SELECT ... FOR UPDATE can lock them all.
    existing = _read(conn, keys, lock=False)
    missing = [k for k in keys if k not in existing]
    if missing:
        if conn.dialect.name == dialects.POSTGRESQL:
            for job_id, step in missing:
                dialects.insert_ignore(conn, t, {"job_id": job_id, "step": step, **empty})
        else:
            conn.execute(t.insert(), [{"job_id": j, "step": s, **empty} for j, s in missing])
    current = _read(conn, keys, lock=conn.dialect.name == dialects.POSTGRESQL)
    rows = []
    for key in keys:
        cells = grouped[key]
        blobs = current[key]
        rows.append(
            {
                "k_job": key[0],
                "k_step": key[1],
                **{
                    m: patch(blobs[i], ((c[0], c[i + 1]) for c in cells))
                    for i, m in enumerate(METRICS)
                },
            }
        )
    conn.execute(
        update(t)
        .where(t.c.job_id == bindparam("k_job"), t.c.step == bindparam("k_step"))
        .values({m: bindparam(m) for m in METRICS}),
        rows,
    )


def _read(
    conn: Connection, keys: Sequence[tuple[str, int]], *, lock: bool
) -> dict[tuple[str, int], tuple[bytes, bytes, bytes]]:
    t = tables.step_matrix
    found: dict[tuple[str, int], tuple[bytes, bytes, bytes]] = {}
    for start in range(0, len(keys), 500):  # bounded IN lists
        chunk = keys[start : start + 500]
        query = select(t.c.job_id, t.c.step, t.c.step_time, t.c.comm_wait, t.c.mfu).where(
            tuple_(t.c.job_id, t.c.step).in_(chunk)
        )
        if lock:
            query = query.order_by(t.c.job_id, t.c.step).with_for_update()
        for job_id, step, *blobs in conn.execute(query):
            found[(job_id, step)] = (blobs[0], blobs[1], blobs[2])
    return found
