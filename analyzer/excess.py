"""Whether a persistent compute straggler's unsmoothed steps carry the evidence to report it.

Persistence is judged on smoothed scores (`stragglers.score`), which a clean rank's run of high
jitter draws can pass; the rank's own steps must also show it late. Per step its excess score
(`scores`) is its compute less its peers' median, over the robust scale of those deviations.
The evidence (`evident`, whichever comes first) is either their accumulated excess, clipped at
`evidence_clip` (one hiccup adds little), less `evidence_allowance` a step, summed over its best
run of its last 1..`evidence_steps` steps (a CUSUM that forgets), past `evidence_threshold`; or,
since the clip caps the slow steps of a rank slow only every few steps while its other steps
give back as much, `periodic_excursions` of its last `evidence_steps` steps at the clip on one
phase of a period (`shape.period`). A steady straggler flagged in fewer steps than persistence
asks (`strong_hits`, short of `min_hits`) needs `strong_evidence` times the accumulated excess
(`strongly_evident`). Pure numpy over `StepArrays`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import findings, robust, shape


def scores(
    a: arrays_mod.StepArrays,
    groups: npt.NDArray[np.int32] | None,
    cfg: config_mod.StragglerConfig,
) -> robust.FloatArray:
    """[steps, ranks]: per step, each rank's compute less the median of its scoring group's
    other ranks' (`groups`: `stragglers.stage_groups`; None: all ranks) as a share of the
    step's median step time, over the robust scale of those deviations pooled over the group's
    ranks and last steps (at least `scale_samples` of them)."""
    compute = a.known_compute_s()
    with np.errstate(all="ignore"):
        step_time = robust.nanmedian(a.step_time_s, 1, keepdims=True)
        deviation = (compute - robust.others_median(compute, groups)) / step_time
    x = np.full(deviation.shape, np.nan)
    for cols in [np.arange(a.num_ranks)] if groups is None else robust.group_columns(groups):
        rows = robust.pool_rows(cols.size, cfg.scale_samples, cfg.evidence_steps)
        deviations = deviation[:, cols]
        mad = robust.pooled_mad(deviations, rows)
        with np.errstate(invalid="ignore"):
            x[:, cols] = deviations / np.fmax(robust.MAD_TO_SIGMA * mad, cfg.scale_floor)
    return x


def accumulate(
    x: robust.FloatArray, cfg: config_mod.StragglerConfig, *, steady: bool = False
) -> robust.FloatArray:
    """[steps, ranks]: the accumulated excess of `scores`: clipped, less the allowance a step,
    summed over the best run of the last 1..`evidence_steps` steps; for a `steady` straggler's
    episode, each run's largest step left out (its claim rests on its usual steps: a hiccup or
    two adds nothing to it, while an intermittent one's recurring slow steps are its claim)."""
    clipped = np.clip(x, -cfg.evidence_clip, cfg.evidence_clip)
    return robust.accumulated_excess(
        clipped, cfg.evidence_allowance, cfg.evidence_steps, leave_out_largest=steady
    )


def evident(
    steps: npt.NDArray[np.int64],
    x: robust.FloatArray,
    accumulated: robust.FloatArray,
    at: int,
    last: int,
    cfg: config_mod.StragglerConfig,
    *,
    steady: bool = False,
) -> tuple[int, schema.Evidence] | None:
    """The first row from `at` (persistent) to `last` by which one column's excess scores `x`
    (with their `accumulated` excess, `accumulate(..., steady=steady)`) carry the evidence
    either way, and that evidence; None: never."""
    reached = np.flatnonzero(accumulated[at : last + 1] > cfg.evidence_threshold)
    if reached.size:
        row = at + int(reached[0])
        # The period's evidence can come first (each slow step is capped in the sum).
        return _periodic(steps, x, at, row - 1, cfg) or (
            row,
            _accumulated_evidence(float(accumulated[row]), cfg, steady=steady),
        )
    return _periodic(steps, x, at, last, cfg)


def strongly_evident(
    x: robust.FloatArray, at: int, last: int, cfg: config_mod.StragglerConfig, *, skip: int = 0
) -> tuple[int, schema.Evidence] | None:
    """The first row from `at` to `last` by which a steady straggler flagged in only
    `cfg.strong_hits` of its last `window` steps carries `cfg.strong_evidence` times the
    evidence (the accumulated excess of its scores `x`, one column, past its first `skip`
    rows: a rank slow only while the job starts up carries none), and that evidence; None:
    never."""
    x = x.copy()
    x[:skip] = np.nan
    accumulated = accumulate(x[:, None], cfg, steady=True)[:, 0]
    bar = cfg.strong_evidence * cfg.evidence_threshold
    reached = np.flatnonzero(accumulated[at : last + 1] > bar)
    if not reached.size:
        return None
    row = at + int(reached[0])
    return row, _accumulated_evidence(float(accumulated[row]), cfg, steady=True, strong=True)


def _periodic(
    steps: npt.NDArray[np.int64],
    x: robust.FloatArray,
    at: int,
    last: int,
    cfg: config_mod.StragglerConfig,
) -> tuple[int, schema.Evidence] | None:
    """The first row from `at` to `last` by which `cfg.periodic_excursions` of the column's
    last `evidence_steps` excess scores `x` reached the clip on one phase of a period (counted
    from the first of them, so that the steps before a fault's onset do not dilute it), and
    that evidence; None: none did."""
    with np.errstate(invalid="ignore"):
        big = x >= cfg.evidence_clip  # NaN: not an excursion
    counts = np.concatenate([[0], np.cumsum(big)])
    for row in range(at, last + 1):
        lo = max(0, row + 1 - cfg.evidence_steps)
        count = int(counts[row + 1] - counts[lo])
        if count < cfg.periodic_excursions:
            continue
        first = lo + int(np.argmax(big[lo : row + 1]))  # its first excursion: a fault's onset
        every = shape.period(steps[first : row + 1], big[first : row + 1])
        if every:
            note = (
                f"steps at {cfg.evidence_clip:g}+ robust standard deviations over its peers' "
                f"median compute / its last steps, every {shape.ordinal(every)} step (the "
                "accumulated excess caps each step at that)"
            )
            return row, findings.evidence("periodic_excursions", count, row + 1 - lo, note=note)
    return None


def _accumulated_evidence(
    value: float, cfg: config_mod.StragglerConfig, *, steady: bool, strong: bool = False
) -> schema.Evidence:
    """`strong`: carried by a straggler flagged in `strong_hits` of its window's steps, whose
    threshold is `strong_evidence` times the usual one."""
    bar = cfg.evidence_threshold * (cfg.strong_evidence if strong else 1.0)
    return findings.evidence(
        "accumulated_excess",
        value,
        bar,
        note="per-step compute over the peers' median, in robust standard deviations, "
        f"less {cfg.evidence_allowance:g} a step, summed over its last "
        f"{cfg.evidence_steps} steps at most (CUSUM"
        + (", its largest step left out" if steady else "")
        + "); the threshold as the baseline"
        + (
            f" ({cfg.strong_evidence:g}x the usual: flagged in {cfg.strong_hits}, not yet "
            f"{cfg.min_hits}, of {cfg.window} steps)"
            if strong
            else ""
        ),
    )
