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
from collections.abc import Sequence
from itertools import repeat

from sqlalchemy import select, tuple_
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from vigil import schema
from vigil.collector import dialects, tables

METRICS = ("step_time", "comm_wait", "mfu")
NAN = math.nan
_EMPTY = {m: b"" for m in METRICS}


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


def patch(blob: bytes | None, ranks: Sequence[int], values: Sequence[float]) -> bytes:
    """Set `values[i]` at `ranks[i]` in a packed array, growing it with NaN (missing) as needed."""
    cells = unpack(blob) if blob else array("d")
    top = max(ranks, default=-1) + 1
    if top > len(cells):
        cells.extend(repeat(NAN, top - len(cells)))
    for rank, value in zip(ranks, values, strict=True):
        cells[rank] = value
    return pack(cells)


class _Cells:
    """The cells one batch sets in one (job, step): ranks and each metric's values."""

    __slots__ = ("comm_wait", "mfu", "ranks", "step_time")

    def __init__(self) -> None:
        self.ranks: list[int] = []
        self.step_time: list[float] = []
        self.comm_wait: list[float] = []
        self.mfu: list[float] = []


def _cells(records: Sequence[schema.StepRecord]) -> dict[tuple[str, int], _Cells]:
    grouped: dict[tuple[str, int], _Cells] = defaultdict(_Cells)
    for r in records:
        cells = grouped[(r.job_id, r.step)]
        cells.ranks.append(r.rank)
        cells.step_time.append(r.end_s - r.start_s)
        cells.comm_wait.append(r.comm_wait_s)
        cells.mfu.append(r.mfu)
    return grouped


def write(conn: Connection, records: Sequence[schema.StepRecord]) -> None:
    """Patch the matrices of every (job, step) in `records` inside the caller's transaction."""
    grouped = _cells(records)
    keys = sorted(grouped)
    t = tables.step_matrix
    locking = conn.dialect.name == dialects.POSTGRESQL
    if locking:
        # Create missing rows first so SELECT ... FOR UPDATE can lock every row this batch
        # patches: concurrent batches on one step then serialise instead of losing cells.
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            conn.execute(
                postgresql.insert(t)
                .values([{"job_id": j, "step": s, **_EMPTY} for j, s in chunk])
                .on_conflict_do_nothing()
            )
    current = _read(conn, keys, lock=locking)
    rows = []
    for key in keys:
        cells = grouped[key]
        blobs = current.get(key, (b"", b"", b""))
        rows.append(
            {
                "job_id": key[0],
                "step": key[1],
                "step_time": patch(blobs[0], cells.ranks, cells.step_time),
                "comm_wait": patch(blobs[1], cells.ranks, cells.comm_wait),
                "mfu": patch(blobs[2], cells.ranks, cells.mfu),
            }
        )
    dialects.upsert(conn, t, rows)


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
