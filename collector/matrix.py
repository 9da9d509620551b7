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
from operator import itemgetter
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from sqlalchemy import select, tuple_
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from vigil import schema
from vigil.collector import dialects, tables

METRICS = ("step_time", "comm_wait", "mfu")
NAN = math.nan


def struct_columns(cls: type[msgspec.Struct]) -> list[str]:
    """Table column names of a wire struct's fields, in field order (`group` is a keyword)."""
    return ["group_name" if f == "group" else f for f in cls.__struct_fields__]


# Step rows are StepRecord field tuples (see writes.py): these are their positions.
STEP_COLUMNS = struct_columns(schema.StepRecord)
_JOB, _STEP, _RANK = (STEP_COLUMNS.index(c) for c in ("job_id", "step", "rank"))
_START, _END = STEP_COLUMNS.index("start_s"), STEP_COLUMNS.index("end_s")
_COMM_WAIT, _MFU = STEP_COLUMNS.index("comm_wait_s"), STEP_COLUMNS.index("mfu")
_EMPTY = {m: b"" for m in METRICS}
_NO_BLOBS = (b"", b"", b"")


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


def widened(blob: bytes | None, width: int) -> array[float]:
    """A packed array as an array of at least `width` cells, padded with NaN (missing)."""
    cells = unpack(blob) if blob else array("d")
    if width > len(cells):
        cells.extend(repeat(NAN, width - len(cells)))
    return cells


def write(conn: Connection, rows: Sequence[tuple[Any, ...]]) -> None:
    """Patch the matrices of every (job, step) in step `rows` (STEP_COLUMNS order) inside the
    caller's transaction; a later row for the same cell wins."""
    if not rows:
        return
    keys_of_rows = list(zip(map(itemgetter(_JOB), rows), map(itemgetter(_STEP), rows), strict=True))
    ranks = list(map(itemgetter(_RANK), rows))
    keys = sorted(set(keys_of_rows))
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
    n = len(rows)
    index = {key: i for i, key in enumerate(keys)}
    key_ids = np.fromiter(map(index.__getitem__, keys_of_rows), dtype=np.intp, count=n)
    rank_ids = np.fromiter(ranks, dtype=np.intp, count=n)
    # Each (job, step) keeps at least its stored width; `width` covers this batch's ranks.
    widths = [
        max(len(current.get(key, _NO_BLOBS)[0]) // 8, int(rank_ids.max()) + 1) for key in keys
    ]
    width = max(widths)
    grid = np.full((len(METRICS), len(keys), width), NAN, dtype="<f8")
    for i, key in enumerate(keys):
        for m, blob in enumerate(current.get(key, _NO_BLOBS)):
            if blob:
                grid[m, i, : len(blob) // 8] = np.frombuffer(blob, dtype="<f8")
    # A later row for the same cell wins: keep each cell's last occurrence only.
    cells = key_ids * width + rank_ids
    _, last_reversed = np.unique(cells[::-1], return_index=True)
    keep = n - 1 - last_reversed
    cells = cells[keep]

    def column(position: int) -> npt.NDArray[np.float64]:
        values: npt.NDArray[np.float64] = np.fromiter(
            map(itemgetter(position), rows), dtype=np.float64, count=n
        )
        picked: npt.NDArray[np.float64] = values[keep]
        return picked

    flat = grid.reshape(len(METRICS), -1)
    flat[0, cells] = column(_END) - column(_START)
    flat[1, cells] = column(_COMM_WAIT)
    flat[2, cells] = column(_MFU)
    patched = [
        {
            "job_id": key[0],
            "step": key[1],
            **{m: grid[j, i, : widths[i]].tobytes() for j, m in enumerate(METRICS)},
        }
        for i, key in enumerate(keys)
    ]
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
