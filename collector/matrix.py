"""Rank-major step matrices: per (job, step) one float64 array per heatmap metric.

A rank x step heatmap of a 1,024-rank job over 1,000 steps is a million cells; reading them as a
million rows costs seconds, reading 1,000 rows of packed arrays costs milliseconds. Ingest patches
the cells of the ranks a batch carries (a re-run step overwrites its cells, like step_records):
SQLite reads, patches in numpy and writes back (one writer at a time); PostgreSQL overlays each
run of adjacent ranks in the server, so stored matrices never travel. Pure packing helpers plus
the SQL; must not commit.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from sqlalchemy import select, tuple_
from sqlalchemy.engine import Connection

from vigil import columns, schema
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


@dataclass(frozen=True, kw_only=True)
class Runs:
    """A batch's cells as contiguous runs of ranks, each run's values packed per metric.

    `level[i]` is run i's position among the runs of its (job, step): one SQL UPDATE can patch
    a row once, so runs of equal level go together. Keys are sorted; runs follow key then rank.
    """

    job_ids: list[str]
    steps: list[int]
    first_ranks: list[int]
    blobs: tuple[list[bytes], list[bytes], list[bytes]]  # per METRICS, per run
    levels: list[int]


def runs(rows: Sequence[tuple[Any, ...]], steps: columns.StepColumns | None = None) -> Runs:
    """Pure: step `rows` (STEP_COLUMNS order; `steps` their columns, if built already) as runs
    of adjacent ranks; a later row for the same cell wins."""
    steps = steps if steps is not None else columns.from_rows(rows)
    key_ids, keys = _keys(steps)
    n = len(steps)
    rank_ids = steps.column("rank").astype(np.int64)
    width = int(rank_ids.max()) + 1
    # np.unique sorts: cells come out by key, then rank; the reversed view keeps the last row.
    cells, last_reversed = np.unique((key_ids * width + rank_ids)[::-1], return_index=True)
    keep = n - 1 - last_reversed
    values = _metric_values(steps, keep)
    cell_keys, cell_ranks = np.divmod(cells, width)
    # A run breaks where the key changes or a rank is skipped.
    breaks = np.flatnonzero((np.diff(cell_keys) != 0) | (np.diff(cell_ranks) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(cells)]))
    run_keys = cell_keys[starts]
    new_key = np.concatenate(([True], run_keys[1:] != run_keys[:-1]))
    first_of_key = np.maximum.accumulate(np.where(new_key, np.arange(len(starts)), 0))
    return Runs(
        job_ids=[keys[k][0] for k in run_keys.tolist()],
        steps=[keys[k][1] for k in run_keys.tolist()],
        first_ranks=cell_ranks[starts].tolist(),
        blobs=tuple(  # type: ignore[arg-type]
            [v[a:b].tobytes() for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
            for v in values
        ),
        levels=(np.arange(len(starts)) - first_of_key).tolist(),
    )


def _keys(
    steps: columns.StepColumns,
) -> tuple[npt.NDArray[np.int64], list[tuple[str, int]]]:
    """Per record, the index of its (job, step) among the batch's sorted distinct keys."""
    step_ids = steps.column("step").astype(np.int64)
    jobs = steps.jobs()
    if len(jobs) == 1:  # one sender's batch: the steps alone order the keys
        job = jobs.pop()
        distinct, inverse = np.unique(step_ids, return_inverse=True)
        return inverse.astype(np.int64), [(job, s) for s in distinct.tolist()]
    keys_of_rows = list(zip(steps.job_ids, step_ids.tolist(), strict=True))
    keys = sorted(set(keys_of_rows))
    index = {key: i for i, key in enumerate(keys)}
    n = len(steps)
    return np.fromiter(map(index.__getitem__, keys_of_rows), dtype=np.int64, count=n), keys


def _metric_values(
    steps: columns.StepColumns, keep: npt.NDArray[np.int64]
) -> list[npt.NDArray[np.float64]]:
    """Per METRICS, the little-endian float64 values of the records at `keep`."""
    step_time = steps.column("end_s")[keep] - steps.column("start_s")[keep]
    picked = [step_time, steps.column("comm_wait_s")[keep], steps.column("mfu")[keep]]
    return [np.ascontiguousarray(v, dtype="<f8") for v in picked]


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What `apply` writes: runs for PostgreSQL's in-server patch, or columns for SQLite's."""

    runs: Runs | None
    steps: columns.StepColumns


def prepare(
    conn: Connection,
    rows: Sequence[tuple[Any, ...]] | None,
    steps: columns.StepColumns | None = None,
) -> Prepared:
    """The CPU half of `write`, no SQL: callers run it while the server is busy elsewhere
    (`rows` may be None when `steps` is given)."""
    if steps is None:
        steps = columns.from_rows(rows or [])
    postgres = conn.dialect.name == dialects.POSTGRESQL
    return Prepared(runs=runs(rows or [], steps) if postgres and len(steps) else None, steps=steps)


def apply(conn: Connection, prepared: Prepared) -> None:
    """The SQL half of `write`."""
    if not len(prepared.steps):
        return
    if prepared.runs is not None:
        _write_postgres(conn, prepared.runs)
    else:
        _write_sqlite(conn, prepared.steps)


def write(
    conn: Connection, rows: Sequence[tuple[Any, ...]], steps: columns.StepColumns | None = None
) -> None:
    """Patch the matrices of every (job, step) in step `rows` (STEP_COLUMNS order; `steps`
    their columns, if built already) inside the caller's transaction; a later row for the same
    cell wins."""
    apply(conn, prepare(conn, rows, steps))


# NaN (missing) as stored: little-endian float64 quiet NaN.
_NAN_HEX = "000000000000f87f"
_PG_MISSING = """
INSERT INTO step_matrix (job_id, step, step_time, comm_wait, mfu)
SELECT k.job_id, k.step, '', '', '' FROM unnest(%s::text[], %s::int8[]) AS k(job_id, step)
ORDER BY 1, 2
ON CONFLICT DO NOTHING
"""
# Row locks in key order, so concurrent batches on shared steps queue instead of deadlocking.
_PG_LOCK = """
SELECT 1 FROM step_matrix AS m JOIN unnest(%s::text[], %s::int8[]) AS k(job_id, step)
ON m.job_id = k.job_id AND m.step = k.step
ORDER BY m.job_id, m.step FOR UPDATE OF m
"""


def _pg_patched(column: str) -> str:
    """`column` with run bytes placed at the run's offset, NaN-padded up to it."""
    pad = f"decode(repeat('{_NAN_HEX}', greatest(r.off - length(m.{column}), 0) / 8), 'hex')"
    return f"{column} = overlay(m.{column} || {pad} placing r.{column} from r.off + 1)"


_PG_PATCH = f"""
UPDATE step_matrix AS m SET {", ".join(_pg_patched(c) for c in METRICS)}
FROM unnest(%b::text[], %b::int8[], %b::int4[], %b::bytea[], %b::bytea[], %b::bytea[])
    AS r(job_id, step, off, {", ".join(METRICS)})
WHERE m.job_id = r.job_id AND m.step = r.step
"""


def _write_postgres(conn: Connection, patch: Runs) -> None:
    """Patch in the server: rows are created if missing, locked in key order, and each run's
    bytes overlaid in place, so no stored matrix travels to the collector and back (an UPDATE
    re-reads a row changed by a concurrent batch once its lock is granted)."""
    driver = conn.connection.driver_connection
    assert driver is not None
    keys = sorted(set(zip(patch.job_ids, patch.steps, strict=True)))
    key_jobs, key_steps = [k[0] for k in keys], [k[1] for k in keys]
    with driver.pipeline(), driver.cursor() as cursor:
        cursor.execute(_PG_MISSING, (key_jobs, key_steps))
        cursor.execute(_PG_LOCK, (key_jobs, key_steps))
        for level in range(max(patch.levels) + 1):
            chosen = [i for i, run_level in enumerate(patch.levels) if run_level == level]
            cursor.execute(
                _PG_PATCH,
                (
                    [patch.job_ids[i] for i in chosen],
                    [patch.steps[i] for i in chosen],
                    [patch.first_ranks[i] * 8 for i in chosen],
                    *([blobs[i] for i in chosen] for blobs in patch.blobs),
                ),
            )


def _write_sqlite(conn: Connection, steps: columns.StepColumns) -> None:
    """Read, patch in numpy, write back: SQLite's one writer at a time makes this safe."""
    key_ids, keys = _keys(steps)
    current = _read(conn, keys)
    n = len(steps)
    rank_ids = steps.column("rank").astype(np.int64)
    # Each (job, step) keeps at least its stored width and covers the ranks this batch has for it.
    seen = np.zeros(len(keys), dtype=np.int64)
    np.maximum.at(seen, key_ids, rank_ids + 1)
    widths = [
        max(len(current.get(key, _NO_BLOBS)[0]) // 8, int(top))
        for key, top in zip(keys, seen.tolist(), strict=True)
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
    flat = grid.reshape(len(METRICS), -1)
    for m, values in enumerate(_metric_values(steps, keep)):
        flat[m, cells[keep]] = values
    patched = [
        {
            "job_id": key[0],
            "step": key[1],
            **{m: grid[j, i, : widths[i]].tobytes() for j, m in enumerate(METRICS)},
        }
        for i, key in enumerate(keys)
    ]
    dialects.upsert(conn, tables.step_matrix, patched)


def _read(
    conn: Connection, keys: Sequence[tuple[str, int]]
) -> dict[tuple[str, int], tuple[bytes, bytes, bytes]]:
    t = tables.step_matrix
    found: dict[tuple[str, int], tuple[bytes, bytes, bytes]] = {}
    for start in range(0, len(keys), 500):  # bounded IN lists
        chunk = keys[start : start + 500]
        query = select(t.c.job_id, t.c.step, t.c.step_time, t.c.comm_wait, t.c.mfu).where(
            tuple_(t.c.job_id, t.c.step).in_(chunk)
        )
        for job_id, step, *blobs in conn.execute(query):
            found[(job_id, step)] = (blobs[0], blobs[1], blobs[2])
    return found
