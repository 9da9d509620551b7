"""Robust statistics over step x rank matrices: median/MAD z-scores, persistence and runs.

Pure numpy; arrays are shaped [steps, ranks] so each step's ranks are contiguous. NaN marks a
missing value (a rank that did not report a step) and never counts as an outlier.
"""

from __future__ import annotations

import warnings

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]
BoolArray = npt.NDArray[np.bool_]

# 1.4826 * MAD estimates the standard deviation of normally distributed data.
MAD_TO_SIGMA = 1.4826


def robust_center_scale(
    values: FloatArray,
    *,
    scale_floor: float,
    groups: npt.NDArray[np.integer] | None = None,
    min_samples: int = 1,
    max_rows: int = 1,
) -> tuple[FloatArray, FloatArray]:
    """Per-row median and robust scale of `values` [steps, ranks], optionally per column group.

    The scale is 1.4826 x the median absolute deviation from each row's median. A row of few
    columns (a group of 4 ranks) has too few deviations for a stable MAD (two of four decide
    it, and it swings by 2x from step to step), so the deviations of the last
    ceil(`min_samples` / columns) rows, at most `max_rows`, are pooled (the row's own and
    earlier ones; the first rows pool what they have). With `min_samples` or more columns each
    row's scale is its own MAD.

    Returns arrays broadcastable to `values`. The scale is floored at `scale_floor` x |median| so a
    perfectly regular job does not divide by zero.
    """
    pool = (min_samples, max_rows)
    if groups is None:
        return _center_scale(values, scale_floor, pool)
    center = np.empty_like(values)
    scale = np.empty_like(values)
    for cols in group_columns(groups):
        c, s = _center_scale(values[:, cols], scale_floor, pool)
        center[:, cols] = c
        scale[:, cols] = s
    return center, scale


def nanmedian(values: FloatArray, axis: int, *, keepdims: bool = False) -> FloatArray:
    """np.nanmedian, through np.median when nothing is missing (numpy's NaN-aware median of
    small arrays goes through masked arrays: about 10x slower per call)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN row's median is NaN
        if np.isnan(values).any():
            return np.asarray(np.nanmedian(values, axis=axis, keepdims=keepdims))
        return np.asarray(np.median(values, axis=axis, keepdims=keepdims))


def _center_scale(
    values: FloatArray, scale_floor: float, pool: tuple[int, int] = (1, 1)
) -> tuple[FloatArray, FloatArray]:
    median = nanmedian(values, 1, keepdims=True)
    mad = pooled_mad(values - median, pool_rows(values.shape[1], *pool))
    scale = np.maximum(MAD_TO_SIGMA * mad, scale_floor * np.abs(median))
    scale = np.where(scale > 0, scale, np.finfo(np.float32).tiny)
    return median, scale


def pool_rows(columns: int, min_samples: int, max_rows: int) -> int:
    """How many rows a scale over `columns` columns pools: enough for `min_samples`
    deviations, at most `max_rows` (1: each row alone)."""
    return max(1, min(max_rows, -(-min_samples // max(columns, 1))))


def pooled_mad(deviations: FloatArray, rows: int) -> FloatArray:
    """[steps, 1]: the median absolute value of `deviations` (already about their centre)
    pooled over each row and its `rows - 1` predecessors (1: each row alone)."""
    spread = np.abs(deviations)
    return pooled_median(spread, rows) if rows > 1 else nanmedian(spread, 1, keepdims=True)


def pooled_median(values: FloatArray, rows: int) -> FloatArray:
    """[steps, 1]: the median of each row's and its `rows - 1` predecessors' values (the first
    rows: of what they have), NaN skipped."""
    out = np.empty((values.shape[0], 1), dtype=values.dtype)
    for row in range(values.shape[0]):
        out[row, 0] = nanmedian(values[max(0, row - rows + 1) : row + 1].reshape(1, -1), 1)[0]
    return out


def high_outliers(
    values: FloatArray,
    *,
    z_threshold: float,
    min_excess: float,
    scale_floor: float,
    groups: npt.NDArray[np.integer] | None = None,
    reference: FloatArray | None = None,
    min_samples: int = 1,
    max_rows: int = 1,
) -> tuple[BoolArray, FloatArray, FloatArray]:
    """Which entries are unusually HIGH for their step: robust z above threshold and excess.

    The excess (and the scale's floor) is a fraction of the step's median, or of `reference`
    (broadcastable, e.g. each step's median step time) when given: a rank whose compute is a
    small part of its step must be late by a share of the step, not of that small part, to count.
    `min_samples`, `max_rows`: the scale's pooling over rows (`robust_center_scale`).
    Returns (flags, z, median) with flags/z shaped like `values` and median broadcastable.
    """
    center, scale = robust_center_scale(
        values, scale_floor=scale_floor, groups=groups, min_samples=min_samples, max_rows=max_rows
    )
    base = np.abs(center) if reference is None else reference
    with np.errstate(invalid="ignore"):
        if reference is not None:
            scale = np.maximum(scale, scale_floor * reference)
        z = (values - center) / scale
        flags = (z > z_threshold) & (values - center > min_excess * base)
    return flags, z, center


def rolling_trimmed_mean(values: FloatArray, steps: int) -> FloatArray:
    """Causal, NaN-aware mean of each column's last `steps` rows without the largest of them.

    Averaging a few steps before scoring cuts per-step jitter, so a 10 % straggler stands out
    even when single steps jitter by several percent; leaving out the largest value keeps one
    slow step (a GC pause) from lifting the average of every window it falls in. A missing
    value stays missing.
    """
    if steps <= 1 or values.shape[0] < 2:
        return values
    finite = np.isfinite(values)
    total = np.cumsum(np.where(finite, values, 0.0), axis=0, dtype=np.float64)
    count = np.cumsum(finite, axis=0, dtype=np.int32)
    if steps < values.shape[0]:
        total[steps:] -= total[:-steps].copy()
        count[steps:] -= count[:-steps].copy()
    largest = values.copy()
    for shift in range(1, min(steps, values.shape[0])):
        np.fmax(largest[shift:], values[:-shift], out=largest[shift:])  # fmax skips NaN
    with np.errstate(invalid="ignore", divide="ignore"):
        trimmed = np.where(count > 1, (total - largest) / (count - 1), total / count)
    out = trimmed.astype(values.dtype)
    out[~finite] = np.nan
    return out


def trimmed_mean_last(values: FloatArray, steps: int) -> FloatArray:
    """`rolling_trimmed_mean(values, steps)[-1:]` without computing the earlier rows (the
    streaming analyzer scores one new step at a time)."""
    if steps <= 1 or values.shape[0] < 2:
        return values[-1:]
    window = values[-steps:]
    finite = np.isfinite(window)
    total = np.where(finite, window, 0.0).sum(axis=0, dtype=np.float64, keepdims=True)
    count = finite.sum(axis=0, keepdims=True)
    largest = np.fmax.reduce(window, axis=0, keepdims=True)  # fmax skips NaN
    with np.errstate(invalid="ignore", divide="ignore"):
        trimmed = np.where(count > 1, (total - largest) / (count - 1), total / count)
    out: FloatArray = trimmed.astype(values.dtype)
    out[~finite[-1:]] = np.nan
    return out


def rolling_hits(flags: BoolArray, window: int) -> npt.NDArray[np.int32]:
    """How many of the last `window` steps (rows) each column was flagged, at every row."""
    counts = np.cumsum(flags, axis=0, dtype=np.int32)
    if window < flags.shape[0]:
        counts[window:] -= counts[:-window].copy()
    return counts


def runs(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """Inclusive (first, last) index pairs of the True runs of a 1-D mask."""
    if mask.size == 0:
        return []
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def persistent_episodes(
    flags: npt.NDArray[np.bool_], hits: npt.NDArray[np.int32], min_hits: int
) -> list[tuple[int, int, int]]:
    """Episodes of one column as (first flagged row, last flagged row, row it became persistent).

    `flags` is one column of outlier flags and `hits` its `rolling_hits`; a stretch of nonzero
    hits that never reaches `min_hits` is noise and is dropped.
    """
    episodes = []
    for first, last in runs(hits > 0):
        reached = np.flatnonzero(hits[first : last + 1] >= min_hits)
        if reached.size == 0:
            continue
        flagged = np.flatnonzero(flags[first : last + 1])
        episodes.append(
            (first + int(flagged[0]), first + int(flagged[-1]), first + int(reached[0]))
        )
    return episodes


# Above this many columns a column's own value moves its row's median by a negligible share of
# the spread, so the median of the others is taken as the row's median (no per-column pass).
LEAVE_ONE_OUT_COLUMNS = 64


def others_median(values: FloatArray, groups: npt.NDArray[np.integer] | None = None) -> FloatArray:
    """Each entry's row median over the other columns of its group (NaN skipped; NaN where no
    other column has a value). A deviation from the others' median is distributed alike for
    every column; one from a median that includes the value itself is shrunk toward 0, most
    in small groups (the median of 3 is one of them)."""
    out = np.full(values.shape, np.nan, dtype=np.float64)
    for cols in [np.arange(values.shape[1])] if groups is None else group_columns(groups):
        block = values[:, cols].astype(np.float64)
        if cols.size > LEAVE_ONE_OUT_COLUMNS:
            out[:, cols] = nanmedian(block, 1, keepdims=True)
            continue
        for i, col in enumerate(cols.tolist() if cols.size > 1 else []):
            out[:, col] = nanmedian(np.delete(block, i, axis=1), 1)
    return out


def group_columns(groups: npt.NDArray[np.integer]) -> list[npt.NDArray[np.intp]]:
    """The columns of each group, groups in ascending order."""
    return [np.flatnonzero(groups == g) for g in np.unique(groups)]


def accumulated_excess(
    x: FloatArray, k: float, steps: int, *, leave_out_largest: bool = False
) -> FloatArray:
    """[steps, columns]: at each row, the largest sum of `x - k` over the runs of 1 to `steps`
    rows that end there (a CUSUM that forgets what is older than `steps` rows, so it needs
    only the last `steps` rows and a streaming window reproduces it). NaN adds nothing.
    `leave_out_largest`: each run's sum leaves out its largest term where that is positive, as
    a trimmed mean does (a one-off spike adds nothing; two add one's worth)."""
    rows = x.shape[0]
    terms = np.where(np.isfinite(x), x - k, 0.0)
    total = np.zeros((rows + 1, x.shape[1]))
    np.cumsum(terms, axis=0, out=total[1:])
    if leave_out_largest:
        # Grow the runs backwards a row at a time: the run of `shift + 1` rows ending at row t
        # starts at t - shift, sums total[t + 1] - total[t - shift], and `largest` holds its
        # largest term.
        best = np.full(terms.shape, -np.inf)
        largest = np.full(terms.shape, -np.inf)
        for shift in range(min(steps, rows)):
            np.maximum(largest[shift:], terms[: rows - shift], out=largest[shift:])
            run = total[shift + 1 :] - total[: rows - shift] - np.maximum(largest[shift:], 0.0)
            np.maximum(best[shift:], run, out=best[shift:])
        return best
    # The run ending at row t that starts at row j sums total[t + 1] - total[j]: the largest
    # is total[t + 1] minus the smallest total[j] over j in [t + 1 - steps, t].
    lowest = total[:-1].copy()
    for shift in range(1, min(steps, rows)):
        np.minimum(lowest[shift:], total[:-1][:-shift], out=lowest[shift:])
    out: FloatArray = total[1:] - lowest
    return out
