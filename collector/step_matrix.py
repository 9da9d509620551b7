"""The write side of the heatmaps: the `step_matrix` table, patched by ingest (`heatmap` reads it).

Rank-major step matrices: per (job, step, chunk of 1,024 ranks) one float64 array per metric.

A rank x step heatmap of a 1,024-rank job over 1,000 steps is a million cells; reading them as a
million rows costs seconds, reading 1,000 rows of packed arrays costs milliseconds. A step's ranks
are split into chunks of `CHUNK_RANKS` (chunk = rank // 1024, cell = rank % 1024), and a chunk's
row exists only where one of its ranks reported, so storage follows the ranks that report, not
the largest rank number (one record of rank 131,071 costs 8 KiB per metric, not 1 MiB).
Ingest patches the cells of the ranks a batch carries (a re-run step overwrites its cells, like
step_records): SQLite reads, patches in numpy and writes back (one writer at a time); PostgreSQL
overlays each run of adjacent ranks (runs end at chunk boundaries) in the server, so stored
matrices never travel. Pure packing helpers plus the SQL; must not commit.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from sqlalchemy import select, tuple_
from sqlalchemy.engine import Connection

from vigil import columns, schema
from vigil.collector import dialects, tables

METRICS = ("step_time", "comm_wait", "mfu")
# Ranks per stored row: a lone reporting rank costs at most 8 KiB per metric, and a job of up to
# 1,024 ranks still reads one row per step.
CHUNK_RANKS = 1024
NAN = math.nan


def struct_columns(cls: type[msgspec.Struct]) -> list[str]:
    """Table column names of a wire struct's fields, in field order (`group` is a keyword)."""
    return ["group_name" if f == "group" else f for f in cls.__struct_fields__]


# Step rows are StepRecord field tuples (see writes.py), in this column order.
STEP_COLUMNS = struct_columns(schema.StepRecord)
_NO_BLOBS = (b"", b"", b"")
# A stored row's key: (job_id, step, chunk).
RowKey = tuple[str, int, int]


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


@dataclass(frozen=True, kw_only=True)
class Runs:
    """A batch's cells as contiguous runs of ranks within one chunk, values packed per metric.

    `offsets[i]` is run i's first cell within its chunk (rank % CHUNK_RANKS). `level[i]` is run
    i's position among the runs of its (job, step, chunk) row: one SQL UPDATE can patch a row
    once, so runs of equal level go together. Rows are sorted; runs follow row key then rank.
    """

    job_ids: list[str]
    steps: list[int]
    chunks: list[int]
    offsets: list[int]
    blobs: tuple[list[bytes], list[bytes], list[bytes]]  # per METRICS, per run
    levels: list[int]


def runs(rows: Sequence[tuple[Any, ...]], steps: columns.StepColumns | None = None) -> Runs:
    """Pure: step `rows` (STEP_COLUMNS order; `steps` their columns, if built already) as runs
    of adjacent ranks that never cross a chunk boundary; a later row for the same cell wins."""
    steps = steps if steps is not None else columns.from_rows(rows)
    key_ids, keys = _keys(steps)
    n = len(steps)
    rank_ids = steps.column("rank").astype(np.int64)
    width = int(rank_ids.max()) + 1
    # np.unique sorts: cells come out by key, then rank; the reversed view keeps the last row.
    cell_ids, last_reversed = np.unique((key_ids * width + rank_ids)[::-1], return_index=True)
    keep = n - 1 - last_reversed
    values = _metric_values(steps, keep)
    cell_keys, cell_ranks = np.divmod(cell_ids, width)
    cell_chunks, cell_offsets = np.divmod(cell_ranks, CHUNK_RANKS)
    # A run breaks where the key changes, a rank is skipped or a new chunk begins.
    breaks = (
        np.flatnonzero(
            (np.diff(cell_keys) != 0) | (np.diff(cell_ranks) != 1) | (cell_offsets[1:] == 0)
        )
        + 1
    )
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(cell_ids)]))
    run_keys, run_chunks = cell_keys[starts], cell_chunks[starts]
    new_row = np.concatenate(
        ([True], (run_keys[1:] != run_keys[:-1]) | (run_chunks[1:] != run_chunks[:-1]))
    )
    first_of_row = np.maximum.accumulate(np.where(new_row, np.arange(len(starts)), 0))
    return Runs(
        job_ids=[keys[k][0] for k in run_keys.tolist()],
        steps=[keys[k][1] for k in run_keys.tolist()],
        chunks=run_chunks.tolist(),
        offsets=cell_offsets[starts].tolist(),
        blobs=tuple(  # type: ignore[arg-type]
            [v[a:b].tobytes() for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
            for v in values
        ),
        levels=(np.arange(len(starts)) - first_of_row).tolist(),
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


def _row_keys(
    steps: columns.StepColumns,
) -> tuple[npt.NDArray[np.int64], list[RowKey]]:
    """Per record, the index of its stored row among the batch's sorted distinct row keys."""
    key_ids, keys = _keys(steps)
    chunk_ids = steps.column("rank").astype(np.int64) // CHUNK_RANKS
    num_chunks = int(chunk_ids.max()) + 1
    distinct, inverse = np.unique(key_ids * num_chunks + chunk_ids, return_inverse=True)
    key_of, chunk_of = np.divmod(distinct, num_chunks)
    row_keys = [(*keys[k], c) for k, c in zip(key_of.tolist(), chunk_of.tolist(), strict=True)]
    return inverse.astype(np.int64).reshape(-1), row_keys


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
_PG_KEYS = "unnest(%s::text[], %s::int8[], %s::int4[]) AS k(job_id, step, chunk)"
_PG_MISSING = f"""
INSERT INTO step_matrix (job_id, step, chunk, step_time, comm_wait, mfu)
SELECT k.job_id, k.step, k.chunk, '', '', '' FROM {_PG_KEYS}
ORDER BY 1, 2, 3
ON CONFLICT DO NOTHING
"""
# Row locks in key order, so concurrent batches on shared rows queue instead of deadlocking.
_PG_LOCK = f"""
SELECT 1 FROM step_matrix AS m JOIN {_PG_KEYS}
ON m.job_id = k.job_id AND m.step = k.step AND m.chunk = k.chunk
ORDER BY m.job_id, m.step, m.chunk FOR UPDATE OF m
"""


def _pg_patched(column: str) -> str:
    """`column` with run bytes placed at the run's offset, NaN-padded up to it."""
    pad = f"decode(repeat('{_NAN_HEX}', greatest(r.off - length(m.{column}), 0) / 8), 'hex')"
    return f"{column} = overlay(m.{column} || {pad} placing r.{column} from r.off + 1)"


_PG_PATCH = f"""
UPDATE step_matrix AS m SET {", ".join(_pg_patched(c) for c in METRICS)}
FROM unnest(%b::text[], %b::int8[], %b::int4[], %b::int4[], %b::bytea[], %b::bytea[], %b::bytea[])
    AS r(job_id, step, chunk, off, {", ".join(METRICS)})
WHERE m.job_id = r.job_id AND m.step = r.step AND m.chunk = r.chunk
"""


def _write_postgres(conn: Connection, patch: Runs) -> None:
    """Patch in the server: rows are created if missing, locked in key order, and each run's
    bytes overlaid in place, so no stored matrix travels to the collector and back (an UPDATE
    re-reads a row changed by a concurrent batch once its lock is granted)."""
    driver = conn.connection.driver_connection
    assert driver is not None
    keys = sorted(set(zip(patch.job_ids, patch.steps, patch.chunks, strict=True)))
    key_columns = tuple([k[i] for k in keys] for i in range(3))
    with driver.pipeline(), driver.cursor() as cursor:
        cursor.execute(_PG_MISSING, key_columns)
        cursor.execute(_PG_LOCK, key_columns)
        for level in range(max(patch.levels) + 1):
            chosen = [i for i, run_level in enumerate(patch.levels) if run_level == level]
            cursor.execute(
                _PG_PATCH,
                (
                    [patch.job_ids[i] for i in chosen],
                    [patch.steps[i] for i in chosen],
                    [patch.chunks[i] for i in chosen],
                    [patch.offsets[i] * 8 for i in chosen],
                    *([blobs[i] for i in chosen] for blobs in patch.blobs),
                ),
            )


def _write_sqlite(conn: Connection, steps: columns.StepColumns) -> None:
    """Read, patch in numpy, write back: SQLite's one writer at a time makes this safe."""
    row_ids, keys = _row_keys(steps)
    current = _read(conn, keys)
    n = len(steps)
    offsets = steps.column("rank").astype(np.int64) % CHUNK_RANKS
    # Each row keeps at least its stored width and covers the cells this batch has for it;
    # rows lie end to end in one flat array per metric.
    seen = np.zeros(len(keys), dtype=np.int64)
    np.maximum.at(seen, row_ids, offsets + 1)
    widths = [
        max(len(current.get(key, _NO_BLOBS)[0]) // 8, top)
        for key, top in zip(keys, seen.tolist(), strict=True)
    ]
    bounds = np.concatenate(([0], np.cumsum(widths))).tolist()
    flat = np.full((len(METRICS), bounds[-1]), NAN, dtype="<f8")
    for i, key in enumerate(keys):
        for m, blob in enumerate(current.get(key, _NO_BLOBS)):
            if blob:
                flat[m, bounds[i] : bounds[i] + len(blob) // 8] = np.frombuffer(blob, dtype="<f8")
    # A later row for the same cell wins: keep each cell's last occurrence only.
    positions = np.asarray(bounds[:-1], dtype=np.int64)[row_ids] + offsets
    _, last_reversed = np.unique(positions[::-1], return_index=True)
    keep = n - 1 - last_reversed
    for m, values in enumerate(_metric_values(steps, keep)):
        flat[m, positions[keep]] = values
    patched = [
        {
            "job_id": key[0],
            "step": key[1],
            "chunk": key[2],
            **{m: flat[j, bounds[i] : bounds[i + 1]].tobytes() for j, m in enumerate(METRICS)},
        }
        for i, key in enumerate(keys)
    ]
    dialects.upsert(conn, tables.step_matrix, patched)


def _read(conn: Connection, keys: Sequence[RowKey]) -> dict[RowKey, tuple[bytes, bytes, bytes]]:
    t = tables.step_matrix
    found: dict[RowKey, tuple[bytes, bytes, bytes]] = {}
    for start in range(0, len(keys), 500):  # bounded IN lists
        part = keys[start : start + 500]
        query = select(
            t.c.job_id, t.c.step, t.c.chunk, t.c.step_time, t.c.comm_wait, t.c.mfu
        ).where(tuple_(t.c.job_id, t.c.step, t.c.chunk).in_(part))
        for job_id, step, chunk, *blobs in conn.execute(query):
            found[(job_id, step, chunk)] = (blobs[0], blobs[1], blobs[2])
    return found
