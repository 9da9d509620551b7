"""Job-level imbalance: pipeline stages that are persistently slower than the others, and
sequence-length imbalance (ranks' compute follows their uneven share of tokens).

Neither is one rank's fault, so these are reported for the job (or a stage's ranks), and the
straggler detector compares ranks within their stage and discounts token-driven slowness.
Pure numpy over `StepArrays`.
"""

from __future__ import annotations

import warnings

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import findings, robust

# Sequence-length imbalance is reported when tokens per rank spread by more than this
# ((p90 - p10) / median) and compute time follows tokens (correlation above MIN_CORRELATION).
MIN_TOKEN_SPREAD = 0.2
MIN_CORRELATION = 0.7


def stage_levels(
    values: robust.FloatArray, stages: npt.NDArray[np.int32]
) -> tuple[npt.NDArray[np.int32], robust.FloatArray, robust.FloatArray]:
    """(stage ids, each stage's level per row [rows, stages], the median stage's [rows, 1]).

    A stage's level is the lower median of its ranks' values: what more than half of them
    reach, so one straggler among a stage's two ranks does not make its stage slow (the
    median of two is their mean, which such a rank pulls up by half of its excess), while a
    stage whose every rank computes more is."""
    stage_ids = np.unique(stages)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a row with no value: NaN
        levels = np.stack(
            [
                np.nanquantile(values[:, stages == s], 0.5, axis=1, method="lower")
                for s in stage_ids
            ],
            axis=1,
        )
        center = np.nanmedian(levels, axis=1, keepdims=True)
    return stage_ids, levels, center


def stage_findings(
    a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig
) -> list[schema.Finding]:
    """A finding per pipeline stage whose level (`stage_levels`) of compute is persistently
    above the median stage's."""
    if a.stages is None or np.unique(a.stages).size < 2:
        return []
    stage_ids, per_stage, center = stage_levels(a.compute_s(), a.stages)
    with np.errstate(all="ignore"):
        ratio = per_stage / center
    flags = ratio > 1.0 + 2 * cfg.min_excess
    hits = robust.rolling_hits(flags, cfg.window)
    out = []
    for j in np.flatnonzero((hits >= cfg.min_hits).any(axis=0)):
        for first, last, _at in robust.persistent_episodes(flags[:, j], hits[:, j], cfg.min_hits):
            rows = slice(first, last + 1)
            observed = float(np.nanmedian(per_stage[rows, j]))
            baseline = float(np.nanmedian(center[rows]))
            ranks = [int(r) for r in a.ranks[a.stages == stage_ids[j]]]
            out.append(
                findings.make_finding(
                    kind=schema.FindingKind.STAGE_IMBALANCE,
                    job_id=a.job_id,
                    subjects=schema.Subjects(ranks=ranks),
                    step_start=int(a.steps[first]),
                    step_end=int(a.steps[last]),
                    summary=(
                        f"pipeline stage {int(stage_ids[j])} computes {observed / baseline:.2f}x "
                        f"the median stage: the pipeline waits on it every step"
                    ),
                    evidence=[
                        findings.evidence("stage_compute_time", observed, baseline, unit="s"),
                        findings.evidence("stage", float(stage_ids[j])),
                    ],
                    confidence=0.85,
                    detected_s=float(np.nan_to_num(a.step_end_s[last])),
                )
            )
    return out


def seqlen_finding(a: arrays_mod.StepArrays) -> schema.Finding | None:
    """Report the job when compute time tracks an uneven split of tokens across ranks."""
    if a.num_ranks < 4 or not _varies(a.tokens):
        return None
    tokens = a.tokens.astype(np.float64)
    compute = a.compute_s().astype(np.float64)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p10, p50, p90 = np.nanpercentile(tokens, [10, 50, 90], axis=1)
        spread = np.nanmedian((p90 - p10) / p50)
        tz = (tokens - np.nanmean(tokens, axis=1, keepdims=True)) / np.nanstd(
            tokens, axis=1, keepdims=True
        )
        cz = (compute - np.nanmean(compute, axis=1, keepdims=True)) / np.nanstd(
            compute, axis=1, keepdims=True
        )
        corr = float(np.nanmedian(np.nanmean(tz * cz, axis=1)))
        c10, c50, c90 = np.nanpercentile(compute, [10, 50, 90], axis=1)
        compute_spread = float(np.nanmedian((c90 - c10) / c50))
    if not (spread > MIN_TOKEN_SPREAD and corr > MIN_CORRELATION):
        return None
    return findings.make_finding(
        kind=schema.FindingKind.SEQLEN_IMBALANCE,
        job_id=a.job_id,
        subjects=schema.Subjects(),
        step_start=int(a.steps[0]),
        step_end=int(a.steps[-1]),
        summary=(
            f"sequence-length imbalance: tokens per rank spread {spread:.0%} (p90-p10 over median) "
            f"and compute follows them (correlation {corr:.2f}); balance batches by tokens"
        ),
        evidence=[
            findings.evidence("tokens_spread", float(spread), MIN_TOKEN_SPREAD),
            findings.evidence("compute_spread", compute_spread),
            findings.evidence("compute_tokens_correlation", corr, MIN_CORRELATION),
        ],
        confidence=min(0.95, 0.5 + corr / 2),
        detected_s=float(np.nan_to_num(a.step_end_s[-1])),
    )


def _varies(values: robust.FloatArray) -> bool:
    finite = values[np.isfinite(values)]
    return (
        bool(finite.size) and float(finite.max()) > float(finite.min()) and float(finite.max()) > 0
    )
