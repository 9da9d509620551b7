"""The read side of the heatmaps: rank x step matrices of step time, exposed communication wait
or MFU, for the query API (`step_matrix` writes them at ingest).

Reads the packed per-chunk arrays of `step_matrix` (one row per step and chunk of 1,024 ranks,
not per cell), so a 1,024-rank x 1,000-step matrix is 1,000 rows. Only ranks with at least one
value in the range are listed, so a job whose only rank is 131,071 answers one column, not
131,072. Ranges wider than `max_steps` are reduced over runs of `stride` consecutive steps: by
their mean (the query API's default) or by their maximum or minimum (`Reduce`; the web UI keeps
the worst cell, so one slow step is never averaged away). `matrix` gives the same as numpy
arrays for callers that reduce further (the UI's rank downsampling). Missing cells are NaN here
and null in JSON. Must not write.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import select
from sqlalchemy.engine import Connection

from vigil.collector import dialects, step_matrix, tables


class HeatmapMetric(enum.StrEnum):
    STEP_TIME = "step_time"  # seconds, end_s - start_s
    COMM_WAIT = "comm_wait"  # seconds of exposed communication wait
    MFU = "mfu"  # model FLOPs utilisation, 0..1


class Reduce(enum.StrEnum):
    """How the steps of one column become one value."""

    MEAN = "mean"  # the query API's default: a column's typical value
    MAX = "max"  # the worst of step time or wait: one slow step stays visible
    MIN = "min"  # the worst of MFU


Matrix = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.float64]]


def heatmap(
    conn: Connection,
    job_id: str,
    *,
    metric: HeatmapMetric,
    step_start: int,
    step_end: int,
    max_steps: int,
    reduce: Reduce = Reduce.MEAN,
) -> dict[str, Any]:
    """`values[i][j]`: the metric of rank `ranks[j]` over the steps of column `i` (`steps[i]`
    onward); `ranks` are the ranks with a value in the range, sorted."""
    stride, (steps, ranks, values) = matrix(
        conn,
        job_id,
        metric=metric,
        step_start=step_start,
        step_end=step_end,
        max_steps=max_steps,
        reduce=reduce,
    )
    return {
        "job_id": job_id,
        "metric": str(metric),
        "stride": stride,
        "ranks": ranks.tolist(),
        "steps": steps.tolist(),
        "values": values.tolist(),
    }


def matrix(
    conn: Connection,
    job_id: str,
    *,
    metric: HeatmapMetric,
    step_start: int,
    step_end: int,
    max_steps: int,
    reduce: Reduce = Reduce.MEAN,
) -> tuple[int, Matrix]:
    """The stride and (column first steps, ranks, values[column, rank]) as numpy arrays."""
    rows = _read(conn, job_id, metric, step_start, step_end)
    stride = max(1, math.ceil((step_end - step_start + 1) / max_steps)) if rows else 1
    return stride, _columns(rows, step_start, stride, reduce)


# PostgreSQL: bytea in the binary protocol. In text, 10,000 ranks x 1,000 steps of float64 are
# 160 MB of hex to send and parse; binary sends the 80 MB as they lie.
_PG_READ = (
    "SELECT step, chunk, {column} FROM step_matrix WHERE job_id = %s AND step BETWEEN %s AND %s "
    "ORDER BY step, chunk"
)


def _read(
    conn: Connection, job_id: str, metric: HeatmapMetric, step_start: int, step_end: int
) -> Sequence[Any]:
    """(step, chunk, packed array) rows of one metric, by step then chunk."""
    if conn.dialect.name == dialects.POSTGRESQL:
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor(binary=True) as cursor:
            # `metric` is a HeatmapMetric: one of the table's column names, never user text.
            cursor.execute(
                _PG_READ.format(column=HeatmapMetric(metric).value),
                (job_id, step_start, step_end),
            )
            found: list[Any] = cursor.fetchall()
            return found
    t = tables.step_matrix
    column = t.c[str(metric)]
    return conn.execute(
        select(t.c.step, t.c.chunk, column)
        .where(t.c.job_id == job_id, t.c.step.between(step_start, step_end))
        .order_by(t.c.step, t.c.chunk)
    ).all()


def _empty() -> Matrix:
    return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0), np.float64)


def _columns(
    rows: Sequence[Any], step_start: int, stride: int, reduce: Reduce = Reduce.MEAN
) -> Matrix:
    """Pure: (step, chunk, array) rows by step then chunk as the first step of each column,
    the ranks with a value and per column each rank's mean (or max, min) over the column's
    steps (NaN where it has none)."""
    if not rows:
        return _empty()
    steps = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    chunks = np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows))
    lengths = np.fromiter((len(r[2]) // 8 for r in rows), dtype=np.int64, count=len(rows))
    data = np.frombuffer(b"".join(r[2] for r in rows), dtype="<f8")
    firsts, column_of_row = np.unique(
        step_start + (steps - step_start) // stride * stride, return_inverse=True
    )
    num_columns = len(firsts)
    column_of_row = column_of_row.reshape(-1)
    if stride == 1 or reduce != Reduce.MEAN:
        by_step = np.unique(steps, return_inverse=True)[1].reshape(-1)
        dense = _dense(chunks, lengths, by_step, data)
        if dense is not None:
            grid = data.reshape(int(by_step.max()) + 1, -1)
            if stride > 1:
                grid = _reduce_steps(
                    grid, column_of_row[np.searchsorted(by_step, np.arange(len(grid)))], reduce
                )
            return firsts, dense, grid
    # Each cell's rank and column; then only the cells with a value.
    cell_ranks = _ranks(chunks, lengths)
    cell_columns = np.repeat(column_of_row.reshape(-1), lengths)
    present = ~np.isnan(data)
    cell_ranks, cell_columns, cell_values = (
        cell_ranks[present],
        cell_columns[present],
        data[present],
    )
    listed = np.zeros(int(cell_ranks.max(initial=-1)) + 1, dtype=bool)  # <= MAX_RANK + 1 bytes
    listed[cell_ranks] = True
    ranks = np.flatnonzero(listed)
    cells = cell_columns * len(ranks) + (np.cumsum(listed) - 1)[cell_ranks]
    size = num_columns * len(ranks)
    counts = np.bincount(cells, minlength=size)
    if reduce == Reduce.MEAN:
        # bincount adds in row order: each mean sums its steps in step order.
        sums = np.bincount(cells, weights=cell_values, minlength=size)
        flat = np.divide(sums, counts, out=np.full(size, math.nan), where=counts > 0)
    else:
        worst = np.maximum if reduce == Reduce.MAX else np.minimum
        flat = np.full(size, -math.inf if reduce == Reduce.MAX else math.inf)
        worst.at(flat, cells, cell_values)
        flat[counts == 0] = math.nan
    return firsts, ranks, flat.reshape(num_columns, len(ranks))


def _reduce_steps(
    grid: npt.NDArray[np.float64], column_of_step: npt.NDArray[np.int64], reduce: Reduce
) -> npt.NDArray[np.float64]:
    """Pure: steps x ranks (steps in order) -> columns x ranks, each column's max or min.
    When every column holds `stride` consecutive steps (no step missing), `stride` passes over
    strided row views; otherwise one `reduceat` (slower along this axis)."""
    worst = np.maximum if reduce == Reduce.MAX else np.minimum
    num_columns = int(column_of_step[-1]) + 1
    stride = math.ceil(len(grid) / num_columns)
    if np.array_equal(column_of_step, np.arange(len(grid)) // stride):
        out = grid[::stride].copy()
        for k in range(1, stride):
            part = grid[k::stride]
            worst(out[: len(part)], part, out=out[: len(part)])
        return out
    starts = np.flatnonzero(np.diff(column_of_step, prepend=-1))
    reduced: npt.NDArray[np.float64] = worst.reduceat(grid, starts)
    return reduced


def _dense(
    chunks: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    column_of_row: npt.NDArray[np.int64],
    data: npt.NDArray[np.float64],
) -> npt.NDArray[np.int64] | None:
    """Pure: the ranks of a read where every step has the same chunks, each as wide, and no
    cell is missing (a dense job, the usual case): the arrays are the matrix as they lie.
    None otherwise."""
    rows_per_column = np.bincount(column_of_row)
    per_step = int(rows_per_column[0])
    if (rows_per_column != per_step).any() or np.isnan(data).any():
        return None
    num_columns = len(rows_per_column)
    layout = np.stack((chunks, lengths)).reshape(2, num_columns, per_step)
    if not (layout == layout[:, :1, :]).all():
        return None
    return _ranks(layout[0, 0], layout[1, 0])


def _ranks(chunks: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Pure: the rank of every cell of arrays `lengths` long of `chunks`, laid end to end."""
    starts = np.cumsum(lengths) - lengths
    return np.repeat(chunks * step_matrix.CHUNK_RANKS - starts, lengths) + np.arange(lengths.sum())
