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
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from vigil.collector import dialects, tables

METRICS = ("step_time", "comm_wait", "mfu")
NAN = math.nan
STEP_COLUMNS = [c.name for c in tables.step_records.columns]
_START, _END = STEP_COLUMNS.index("start_s"), STEP_COLUMNS.index("end_s")
_COMM_WAIT, _MFU = STEP_COLUMNS.index("comm_wait_s"), STEP_COLUMNS.index("mfu")
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


def _cells(rows: Sequence[tuple[Any, ...]]) -> dict[tuple[str, int], _Cells]:
    """Group step rows (STEP_COLUMNS order) by (job, step)."""
    grouped: dict[tuple[str, int], _Cells] = {}
    for row in rows:
        key = (row[0], row[1])
        cells = grouped.get(key)
        if cells is None:
            cells = grouped[key] = _Cells()
        cells.ranks.append(row[2])
        cells.step_time.append(row[_END] - row[_START])
        cells.comm_wait.append(row[_COMM_WAIT])
        cells.mfu.append(row[_MFU])
    return grouped


def write(conn: Connection, rows: Sequence[tuple[Any, ...]]) -> None:
    """Patch the matrices of every (job, step) in step `rows` (STEP_COLUMNS order) inside the
    caller's transaction; later rows of one cell win."""
    if not rows:
        return
    grouped = _cells(rows)
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
    patched = []
    for key in keys:
        cells = grouped[key]
        blobs = current.get(key, (b"", b"", b""))
        patched.append(
            {
                "job_id": key[0],
                "step": key[1],
                "step_time": patch(blobs[0], cells.ranks, cells.step_time),
                "comm_wait": patch(blobs[1], cells.ranks, cells.comm_wait),
                "mfu": patch(blobs[2], cells.ranks, cells.mfu),
            }
        )
    dialects.upsert(conn, t, patched)


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
