"""Rank x step matrices of step time, exposed communication wait or MFU, for heatmaps.

Reads the packed per-step arrays of `matrix` (one row per step, not per cell), so a 1,024-rank x
1,000-step matrix is 1,000 rows. Ranges wider than `max_steps` are averaged over runs of `stride`
consecutive steps. Missing cells are NaN here and null in JSON. Must not write.
"""

from __future__ import annotations

import enum
import math
from array import array
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from vigil.collector import matrix, tables


class HeatmapMetric(enum.StrEnum):
    STEP_TIME = "step_time"  # seconds, end_s - start_s
    COMM_WAIT = "comm_wait"  # seconds of exposed communication wait
    MFU = "mfu"  # model FLOPs utilisation, 0..1


def heatmap(
    conn: Connection,
    job_id: str,
    *,
    metric: HeatmapMetric,
    step_start: int,
    step_end: int,
    max_steps: int,
) -> dict[str, Any]:
    """`values[i][r]`: the metric of rank `r` over the steps of column `i` (`steps[i]` onward)."""
    t = tables.step_matrix
    column = t.c[str(metric)]
    rows: list[Any] = list(
        conn.execute(
            select(t.c.step, column)
            .where(t.c.job_id == job_id, t.c.step.between(step_start, step_end))
            .order_by(t.c.step)
        )
    )
    stride = max(1, math.ceil((step_end - step_start + 1) / max_steps)) if rows else 1
    num_ranks = max((len(blob) // 8 for _, blob in rows), default=0)
    if stride == 1:
        steps = [step for step, _ in rows]
        values = [_padded(matrix.unpack(blob), num_ranks) for _, blob in rows]
    else:
        steps, values = _downsample(rows, step_start, stride, num_ranks)
    return {
        "job_id": job_id,
        "metric": str(metric),
        "stride": stride,
        "ranks": list(range(num_ranks)),
        "steps": steps,
        "values": values,
    }


def _padded(values: array[float], width: int) -> list[float]:
    out = values.tolist()
    if len(out) < width:
        out.extend([math.nan] * (width - len(out)))
    return out


def _downsample(
    rows: list[Any], step_start: int, stride: int, width: int
) -> tuple[list[int], list[list[float]]]:
    """Mean of each rank over each run of `stride` steps (NaN cells ignored)."""
    columns: dict[int, tuple[list[float], list[int]]] = {}
    for step, blob in rows:
        first = step_start + (step - step_start) // stride * stride
        sums, counts = columns.setdefault(first, ([0.0] * width, [0] * width))
        for rank, value in enumerate(matrix.unpack(blob)):
            if not math.isnan(value):
                sums[rank] += value
                counts[rank] += 1
    steps = sorted(columns)
    values = [
        [s / n if n else math.nan for s, n in zip(*columns[first], strict=True)] for first in steps
    ]
    return steps, values
