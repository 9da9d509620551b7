"""The web UI's rank x step heat map: the job's matrix of one metric, rows in the chosen order
(by rank, node or a parallel coordinate), reduced on the server to what a canvas can show.

Both axes are downsampled by keeping the worst value of each block (the maximum; for MFU the
minimum), so one slow cell of a 10,000-rank x 1,000-step job is never averaged away. Colours are
ratios to each column's median over all of the job's ranks, so a zoomed window keeps the colours
of the full view. The answer is binary: a little-endian uint32 length, a JSON header, then the
float32 cells column by column (`encode`). Medians of jobs past 4,096 ranks are taken over
4,096 evenly spaced ranks. Step time, exposed wait, compute and MFU come from the
packed `step_matrix` (through `heatmap.matrix`); collective time and peak memory from the row
tables, bounded by `MAX_ROW_CELLS`. Must not write.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from vigil.collector import heatmap, queries, tables

# Cells read from row tables (collective time, peak memory) in one view: ~50 MB of rows at most.
MAX_ROW_CELLS = 2_000_000
# Ranks a column's median is taken over: its quantile error (~1 % of ranks) is far below what a
# colour shows.
MEDIAN_SAMPLE = 4096
# Ranks listed one by one in an answer (hover and drill-down need them; 10,000 ints is ~60 KB).
MAX_LISTED_RANKS = 20_000


class Metric(enum.StrEnum):
    STEP_TIME = "step_time"
    COMPUTE = "compute"  # step time minus exposed communication wait
    WAIT = "wait"  # exposed communication wait
    COLLECTIVE = "collective"  # device time in collectives (aggregates)
    MFU = "mfu"
    PEAK_MEMORY = "peak_memory"


class Grouping(enum.StrEnum):
    RANK = "rank"
    NODE = "node"
    DP = "dp"
    TP = "tp"
    PP = "pp"


UNITS = {
    Metric.STEP_TIME: "s",
    Metric.COMPUTE: "s",
    Metric.WAIT: "s",
    Metric.COLLECTIVE: "s",
    Metric.MFU: "",
    Metric.PEAK_MEMORY: "B",
}


@dataclass(frozen=True, kw_only=True)
class View:
    """A window of the heat map: steps `step_start..step_end`, rows `row_start..row_end` of the
    grouped order (None: all), at most `max_cols` x `max_rows` cells."""

    metric: Metric
    grouping: Grouping
    step_start: int
    step_end: int
    row_start: int = 0
    row_end: int | None = None
    max_cols: int = 500
    max_rows: int = 800

    def __post_init__(self) -> None:
        if self.step_end < self.step_start:
            raise ValueError(f"step_end ({self.step_end}) is before step_start ({self.step_start})")
        if self.row_end is not None and self.row_end < self.row_start:
            raise ValueError(f"row_end ({self.row_end}) is before row_start ({self.row_start})")
        if not (1 <= self.max_cols <= 4000 and 1 <= self.max_rows <= 4000):
            raise ValueError("max_cols and max_rows must lie in 1..4000")


def worst_is_low(metric: Metric) -> bool:
    return metric == Metric.MFU


def read(conn: Connection, job_id: str, view: View) -> bytes:
    """The encoded view (see the module docstring)."""
    stride, (firsts, ranks, grid) = _matrix(conn, job_id, view)
    medians = _medians(grid)
    order, groups = _order(conn, job_id, ranks, view.grouping)
    total_rows = len(order)
    row_end = total_rows - 1 if view.row_end is None else min(view.row_end, total_rows - 1)
    row_start = min(view.row_start, max(0, row_end))
    window = order[row_start : row_end + 1]
    if view.grouping == Grouping.RANK:
        picked = grid[:, row_start : row_end + 1]  # a view, not a copy
    else:
        picked = grid[:, window] if len(window) else np.zeros((len(firsts), 0))
    rank_stride = max(1, math.ceil(len(window) / view.max_rows))
    cells = _reduce_rows(picked, rank_stride, low=worst_is_low(view.metric))
    header = {
        "metric": str(view.metric),
        "unit": UNITS[view.metric],
        "worst": "min" if worst_is_low(view.metric) else "max",
        "grouping": str(view.grouping),
        "step_stride": stride,
        "steps": firsts.tolist(),
        "step_start": view.step_start,
        "step_end": view.step_end,
        "medians": [None if math.isnan(v) else v for v in medians.tolist()],
        "total_rows": total_rows,
        "row_start": row_start,
        "row_end": row_start + len(window) - 1,
        "rank_stride": rank_stride,
        "num_rows": cells.shape[1],
        "num_cols": cells.shape[0],
        "ranks": ranks[window].tolist() if len(window) <= MAX_LISTED_RANKS else None,
        "groups": [g for g in groups if row_start <= g["row_end"] and g["row_start"] <= row_end],
    }
    return encode(header, cells)


def encode(header: dict[str, Any], cells: npt.NDArray[np.float64]) -> bytes:
    """Pure: uint32 header length, the JSON header padded to 4 bytes, float32 cells by column."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 4)
    return struct.pack("<I", len(text)) + text + np.ascontiguousarray(cells, "<f4").tobytes()


def decode(body: bytes) -> tuple[dict[str, Any], npt.NDArray[np.float32]]:
    """Pure: `encode`'s inverse (tests and benchmarks read answers with it)."""
    (length,) = struct.unpack_from("<I", body)
    header = json.loads(body[4 : 4 + length])
    cells = np.frombuffer(body, "<f4", offset=4 + length)
    return header, cells.reshape(header["num_cols"], header["num_rows"])


def _reduce_rows(
    grid: npt.NDArray[np.float64], stride: int, *, low: bool
) -> npt.NDArray[np.float64]:
    """Pure: columns x ranks -> columns x ceil(ranks / stride), each block's worst (NaN-aware:
    a block is NaN only when all of it is). `stride` passes over strided views: no copy of
    the grid, no padding."""
    if stride == 1 or grid.shape[1] == 0:
        return grid
    worst = np.fmin if low else np.fmax  # fmax/fmin skip NaN
    out: npt.NDArray[np.float64] = grid[:, ::stride].copy()
    for k in range(1, stride):
        part = grid[:, k::stride]
        width = part.shape[1]
        worst(out[:, :width], part, out=out[:, :width])
    return out


def _medians(grid: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Pure: each column's median over its ranks; past `MEDIAN_SAMPLE` ranks, over that many
    evenly spaced ones (a colour scale needs no exact median, and selecting over 10,000 ranks
    x 500 columns costs more than the rest of a view)."""
    if grid.size == 0:
        return np.zeros(grid.shape[0])
    if grid.shape[1] > MEDIAN_SAMPLE:
        grid = grid[:, :: math.ceil(grid.shape[1] / MEDIAN_SAMPLE)]
    if not np.isnan(grid).any():
        return np.median(grid, axis=1)
    with np.errstate(all="ignore"):
        empty = np.asarray(np.isnan(grid).all(axis=1), dtype=bool)
        safe = np.where(empty[:, None], 0.0, grid)
        out: npt.NDArray[np.float64] = np.nanmedian(safe, axis=1)
    out[empty] = math.nan
    return out


def _matrix(conn: Connection, job_id: str, view: View) -> tuple[int, heatmap.Matrix]:
    reduce = heatmap.Reduce.MIN if worst_is_low(view.metric) else heatmap.Reduce.MAX
    args: dict[str, Any] = {
        "step_start": view.step_start,
        "step_end": view.step_end,
        "max_steps": view.max_cols,
        "reduce": reduce,
    }
    stored = {
        Metric.STEP_TIME: heatmap.HeatmapMetric.STEP_TIME,
        Metric.WAIT: heatmap.HeatmapMetric.COMM_WAIT,
        Metric.MFU: heatmap.HeatmapMetric.MFU,
    }
    if view.metric in stored:
        return heatmap.matrix(conn, job_id, metric=stored[view.metric], **args)
    if view.metric == Metric.COMPUTE:
        # Per step first (step time - wait), then the column's worst: max of the differences.
        one = {**args, "max_steps": view.step_end - view.step_start + 1}
        _, (steps, ranks, total) = heatmap.matrix(
            conn, job_id, metric=heatmap.HeatmapMetric.STEP_TIME, **one
        )
        _, (_, wait_ranks, wait) = heatmap.matrix(
            conn, job_id, metric=heatmap.HeatmapMetric.COMM_WAIT, **one
        )
        assert np.array_equal(ranks, wait_ranks), "both come from the same stored rows"
        return _by_stride(steps, ranks, total - wait, view)
    return _from_rows(conn, job_id, view)


def _from_rows(conn: Connection, job_id: str, view: View) -> tuple[int, heatmap.Matrix]:
    """Collective time or peak memory per (step, rank) from the row tables."""
    if view.metric == Metric.COLLECTIVE:
        c = tables.coll_aggs
        query = (
            select(c.c.step, c.c.rank, func.sum(c.c.total_device_s))
            .where(c.c.job_id == job_id, c.c.step.between(view.step_start, view.step_end))
            .group_by(c.c.step, c.c.rank)
        )
    else:
        s = tables.step_records
        query = select(s.c.step, s.c.rank, s.c.peak_memory_bytes).where(
            s.c.job_id == job_id, s.c.step.between(view.step_start, view.step_end)
        )
    rows = conn.execute(query.limit(MAX_ROW_CELLS + 1)).all()
    if len(rows) > MAX_ROW_CELLS:
        raise ValueError(
            f"{view.metric} is read from row tables and steps {view.step_start}..{view.step_end} "
            f"hold more than {MAX_ROW_CELLS} cells: choose a narrower step window"
        )
    if not rows:
        return 1, (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0)))
    data = np.asarray(rows, dtype=np.float64)
    steps, step_of = np.unique(data[:, 0].astype(np.int64), return_inverse=True)
    ranks, rank_of = np.unique(data[:, 1].astype(np.int64), return_inverse=True)
    grid = np.full((len(steps), len(ranks)), math.nan)
    grid[step_of.reshape(-1), rank_of.reshape(-1)] = data[:, 2]
    return _by_stride(steps, ranks, grid, view)


def _by_stride(
    steps: npt.NDArray[np.int64],
    ranks: npt.NDArray[np.int64],
    grid: npt.NDArray[np.float64],
    view: View,
) -> tuple[int, heatmap.Matrix]:
    """Pure: per-step rows reduced to columns of `stride` steps by their worst value."""
    stride = max(1, math.ceil((view.step_end - view.step_start + 1) / view.max_cols))
    if stride == 1 or not len(steps):
        return stride, (steps, ranks, grid)
    low = worst_is_low(view.metric)
    column = (steps - view.step_start) // stride
    firsts, starts = np.unique(column, return_index=True)
    fill = math.inf if low else -math.inf
    filled = np.where(np.isnan(grid), fill, grid)
    reduced = (np.minimum if low else np.maximum).reduceat(filled, starts, axis=0)
    reduced[np.isinf(reduced)] = math.nan
    return stride, (view.step_start + firsts * stride, ranks, reduced)


def _order(
    conn: Connection, job_id: str, ranks: npt.NDArray[np.int64], grouping: Grouping
) -> tuple[npt.NDArray[np.int64], list[dict[str, Any]]]:
    """Positions into `ranks` in row order, and the groups as row ranges with their labels."""
    if grouping == Grouping.RANK or not len(ranks):
        return np.arange(len(ranks)), []
    if grouping == Grouping.NODE:
        nodes = {r["rank"]: r["node"] for r in queries.ranks(conn, job_id)}
        labels = [nodes.get(int(r), "?") for r in ranks.tolist()]
    else:
        job = queries.get_job(conn, job_id) or {}
        layout = {k: int(v) for k, v in (job.get("layout") or {}).items()}
        coordinate = coordinates(ranks, layout)[str(grouping)]
        labels = [f"{grouping} {c}" for c in coordinate.tolist()]
    distinct = sorted(set(labels))
    index = {label: i for i, label in enumerate(distinct)}
    key = np.fromiter((index[x] for x in labels), dtype=np.int64, count=len(labels))
    order = np.lexsort((ranks, key))
    sorted_keys = key[order]
    starts = np.flatnonzero(np.diff(sorted_keys, prepend=-1))
    ends = np.append(starts[1:], len(order)) - 1
    groups = [
        {"label": distinct[int(sorted_keys[a])], "row_start": int(a), "row_end": int(b)}
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
    return order, groups


def coordinates(ranks: npt.NDArray[np.int64], layout: dict[str, int]) -> dict[str, Any]:
    """Pure: each rank's tp, cp, dp and pp coordinate in Megatron's default order (tp fastest,
    then cp, dp, and pp slowest)."""
    tp, cp, dp = (max(1, layout.get(k, 1)) for k in ("tp", "cp", "dp"))
    return {
        "tp": ranks % tp,
        "dp": (ranks // (tp * cp)) % dp,
        "pp": ranks // (tp * cp * dp),
    }
