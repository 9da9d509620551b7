"""MFU drops: a windowed change-point test on per-step MFU (or throughput), and attribution.

At each step the median of the last `recent_steps` values is compared with the median of the
`baseline_steps` before them; a drop larger than `min_drop` of the baseline and `z_threshold`
robust standard errors is a change point, refined to the split that best separates the two
windows. It is reported once it has lasted `min_drop_s` from that change point, the median of
the last `recent_steps` values below the baseline all along (a dip over sooner is none). The
drop is then attributed by which component of step time grew (each one's mean
over the steps before and after the change: means add up as step time does, while a median
hides a fault present in only part of the window): a straggler (max compute per token up,
median not), sequence-length imbalance (max compute up only as far as its rank's larger share
of tokens explains, as in `stragglers.py`), GPU throttling (NVML SM clocks down or a harmful
throttle reason), communication (collective transfer up) or data loading (every rank's: the
median data time up; one rank's: the max's, and that rank is named); a cause that accounts for
less than a quarter of the step time's growth is none ("cause unclear"). A drop blamed on a
rank that the straggler detector also reports, for the same cause over overlapping steps, is
not a second finding: `fold` adds its evidence to that finding instead; so does a slow-link
finding for a drop blamed on communication, and a straggler, data-stall or slow-link finding
for a drop of unclear cause. Pure numpy.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import findings, robust

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True)
class Drop:
    """One change point: the step index it happened at and the levels before/after."""

    change_row: int
    detect_row: int
    end_row: int
    before: float
    after: float
    z: float


def drop_flags(
    series: F64, cfg: config_mod.MfuConfig
) -> tuple[npt.NDArray[np.bool_], F64, F64, F64]:
    """Per index: is the recent window a significant drop below its baseline?

    Returns (flags, baseline level, recent level, z) arrays.
    """
    b, r = cfg.baseline_steps, cfg.recent_steps
    n = series.size
    flags = np.zeros(n, dtype=bool)
    before = np.full(n, np.nan)
    after = np.full(n, np.nan)
    z = np.zeros(n)
    if n < b + r:
        return flags, before, after, z
    windows = np.lib.stride_tricks.sliding_window_view(series, b + r)
    with np.errstate(all="ignore"):
        base = robust.nanmedian(windows[:, :b], 1)
        mad = robust.nanmedian(np.abs(windows[:, :b] - base[:, None]), 1)
        recent = robust.nanmedian(windows[:, b:], 1)
        # Standard error of a median of r values is ~1.25 sigma / sqrt(r).
        scale = np.maximum(robust.MAD_TO_SIGMA * mad, 1e-3 * np.abs(base)) * 1.25 / np.sqrt(r)
        score = (base - recent) / scale
        hit = (recent < base * (1.0 - cfg.min_drop)) & (score > cfg.z_threshold)
    idx = np.arange(b + r - 1, n)
    flags[idx] = hit
    before[idx], after[idx], z[idx] = base, recent, np.nan_to_num(score)
    return flags, before, after, z


def newest_is_drop(series: F64, cfg: config_mod.MfuConfig) -> bool:
    """`drop_flags(series, cfg)[0][-1]`, testing only the newest window (streaming)."""
    span = cfg.baseline_steps + cfg.recent_steps
    return series.size >= span and bool(drop_flags(series[-span:], cfg)[0][-1])


def find_drops(
    series: F64, cfg: config_mod.MfuConfig, times: tuple[F64, F64] | None = None
) -> list[Drop]:
    """Every sustained drop in `series`, each with its refined change point. `times`: each
    step's start and end (seconds), to hold a drop back until it has lasted `cfg.min_drop_s`
    (a drop over before that is none)."""
    flags, before, _after, z = drop_flags(series, cfg)
    drops: list[Drop] = []
    for first, last in robust.runs(flags):
        if last - first + 1 < cfg.recent_steps:
            continue  # a cluster of slow steps, not a sustained drop
        if drops and first < drops[-1].change_row + cfg.baseline_steps + cfg.recent_steps:
            continue  # the same episode: the baseline window still holds the old level
        lo = max(0, first - cfg.recent_steps - cfg.baseline_steps + 1)
        level = float(before[first])
        change = _change_point(series[lo : first + 1], _recovery_level(level, cfg)) + lo
        detect = first + cfg.recent_steps - 1
        if times is not None:
            lasted = _lasted(series, times, change, detect, level, cfg)
            if lasted is None:
                continue
            detect = lasted
        recovered = np.flatnonzero(series[change:] >= _recovery_level(level, cfg))
        end = change + int(recovered[0]) - 1 if recovered.size else series.size - 1
        drops.append(
            Drop(
                change_row=change,
                detect_row=detect,
                end_row=max(end, last - cfg.baseline_steps),
                before=level,
                after=float(np.nanmedian(series[change : first + 1])),
                z=float(z[first : last + 1].max()),
            )
        )
    return drops


def _lasted(
    series: F64,
    times: tuple[F64, F64],
    change: int,
    detect: int,
    level: float,
    cfg: config_mod.MfuConfig,
) -> int | None:
    """The first row from `detect` by whose end the drop has lasted `cfg.min_drop_s` since
    its change point, the median of the last `recent_steps` values still below the baseline
    `level` by half the minimum drop at every row from `detect` on; None: it recovered first
    (or the series ends)."""
    r = cfg.recent_steps
    with np.errstate(invalid="ignore"):  # a step with no time (NaN) is not reached
        reached = np.flatnonzero(times[1][detect:] - times[0][change] >= cfg.min_drop_s)
    if not reached.size:
        return None
    at = detect + int(reached[0])
    recent = np.lib.stride_tricks.sliding_window_view(series[detect - r + 1 : at + 1], r)
    if (robust.nanmedian(recent, 1) >= _recovery_level(level, cfg)).any():
        return None
    return at


def still_down(recent: F64, level: float, cfg: config_mod.MfuConfig) -> bool:
    """Whether the median of the newest `recent_steps` values is still below the baseline
    `level` by half the minimum drop (`_lasted`'s test, one step at a time: streaming)."""
    return bool(np.nanmedian(recent[-cfg.recent_steps :]) < _recovery_level(level, cfg))


def _recovery_level(level: float, cfg: config_mod.MfuConfig) -> float:
    """The value from which a series dropped from baseline `level` counts as back: half the
    minimum drop below it."""
    return level * (1.0 - cfg.min_drop / 2)


def _change_point(values: F64, low: float) -> int:
    """The earliest index from which at least 75 % of the values stay below `low`.

    Robust to isolated slow steps before the real change (a mean-based split is pulled to them).
    """
    below = np.nan_to_num(values, nan=np.inf) < low
    tail_share = np.cumsum(below[::-1])[::-1] / np.arange(values.size, 0, -1)
    ok = np.flatnonzero((tail_share >= 0.75) & below)
    return int(ok[0]) if ok.size else values.size - 1


# The headline metrics of a drop (MFU, or throughput where MFU is unknown): what `folded` adds.
METRICS = frozenset({"mfu", "tokens_per_second"})


def headline_metric(a: arrays_mod.StepArrays) -> str:
    return "mfu" if np.nansum(np.nan_to_num(a.mfu)) > 0 else "tokens_per_second"


def detect(a: arrays_mod.StepArrays, cfg: config_mod.MfuConfig) -> list[schema.Finding]:
    """MFU-drop findings for one job, each attributed to a cause."""
    series = a.job_mfu()
    metric = headline_metric(a)
    drops = find_drops(series, cfg, (a.step_start_s, a.step_end_s))
    return [drop_finding(a, d, metric, cfg) for d in drops]


def drop_finding(
    a: arrays_mod.StepArrays, drop: Drop, metric: str, cfg: config_mod.MfuConfig
) -> schema.Finding:
    pct = 1.0 - drop.after / drop.before if drop.before else 0.0
    cause, subjects, ev, note = attribute(a, drop.change_row, cfg, pct)
    ev.insert(
        0,
        findings.evidence(metric, drop.after, drop.before, note=f"drop {pct:.1%}; z {drop.z:.1f}"),
    )
    return findings.make_finding(
        kind=schema.FindingKind.MFU_DROP,
        job_id=a.job_id,
        subjects=subjects,
        step_start=int(a.steps[drop.change_row]),
        step_end=int(a.steps[min(drop.end_row, a.num_steps - 1)]),
        summary=f"{metric} dropped {pct:.1%} at step {a.steps[drop.change_row]}: {cause}{note}",
        evidence=ev,
        confidence=min(0.95, 0.6 + 0.03 * drop.z),
        detected_s=float(np.nan_to_num(a.step_end_s[drop.detect_row])),
        trace_start_s=float(np.nan_to_num(a.step_start_s[drop.change_row])),
    )


def attribute(
    a: arrays_mod.StepArrays, change: int, cfg: config_mod.MfuConfig, lost: float = 0.0
) -> tuple[str, schema.Subjects, list[schema.Evidence], str]:
    """Which part of step time grew across the change, where the job lost the share `lost` of
    its MFU (or throughput): (cause, subjects, evidence, note)."""
    before = slice(max(0, change - cfg.baseline_steps), change)
    after = slice(change, min(a.num_steps, change + cfg.recent_steps))
    compute = a.compute_s()
    # Compute weighed by tokens: a rank slow only by its larger share of tokens is no straggler.
    weighed = token_weighed(compute, a.tokens)

    def delta(values: robust.FloatArray, reduce: str) -> tuple[float, float]:
        fn = np.nanmax if reduce == "max" else np.nanmedian
        if not np.isfinite(values[before]).any() or not np.isfinite(values[after]).any():
            return 0.0, 0.0
        with np.errstate(all="ignore"):
            x, y = (
                float(np.nanmean(fn(values[before], axis=1))),
                float(np.nanmean(fn(values[after], axis=1))),
            )
        return (0.0 if np.isnan(x) else x), (0.0 if np.isnan(y) else y)

    parts = {
        "data loading": delta(a.data_s, "median"),
        _RANK_DATA: delta(a.data_s, "max"),
        "compute on every rank": delta(compute, "median"),
        "a straggler": delta(weighed, "max"),
        "communication": delta(a.transfer_s, "max"),
    }
    growth = {k: v[1] - v[0] for k, v in parts.items()}
    everywhere = max(0.0, growth["compute on every rank"])
    growth["a straggler"] -= everywhere
    growth[_RANK_DATA] -= max(0.0, growth["data loading"])
    raw_max = delta(compute, "max")
    if weighed is not compute:  # what the most loaded rank's extra tokens alone explain
        parts[_IMBALANCE] = raw_max
        growth[_IMBALANCE] = (
            (raw_max[1] - raw_max[0]) - everywhere - max(0.0, growth["a straggler"])
        )
    cause = max(growth, key=lambda k: growth[k])
    # The step time's growth the drop implies (MFU and throughput go as 1 / step time): the
    # drop is found on medians, which one slow step in a window does not move, as its mean.
    step = delta(a.step_time_s, "median")
    implied = step[0] * (1.0 / (1.0 - lost) - 1.0) if 0.0 < lost < 1.0 else 0.0
    unexplained = growth[cause] < EXPLAINED_SHARE * implied
    ev = [
        findings.evidence(
            {
                "data loading": "data_time",
                _RANK_DATA: "max_data_time",
                "compute on every rank": "compute_time",
                # Weighed by tokens when they vary (then the raw max is the imbalance's).
                "a straggler": (
                    "max_compute_time" if weighed is compute else "max_token_weighed_compute_time"
                ),
                "communication": "max_transfer_time",
                _IMBALANCE: "max_compute_time",
            }[k],
            v[1],
            v[0],
            unit="s",
        )
        for k, v in parts.items()
    ]
    subjects = schema.Subjects()
    if unexplained:
        ev.append(
            findings.evidence(
                "step_time", step[0] + implied, step[0], unit="s", note="as the drop implies"
            )
        )
        return UNCLEAR_LABEL, subjects, ev, ""
    if cause == _IMBALANCE:
        return _imbalance(a, before, after, ev)
    if cause in (_STRAGGLER, _RANK_DATA):
        col = holds_up_most((weighed if cause == _STRAGGLER else a.data_s)[after])
        subjects = schema.Subjects(
            ranks=[int(a.ranks[col])], nodes=[a.nodes[col]] if a.nodes[col] else []
        )
    throttled = _throttled_columns(a, before, after)
    if throttled.size and cause in ("a straggler", "compute on every rank"):
        ranks = [int(a.ranks[c]) for c in throttled]
        nodes = sorted({a.nodes[c] for c in throttled if a.nodes[c]})
        subjects = schema.Subjects(ranks=ranks[:64], nodes=nodes[:64])
        ev.append(
            findings.evidence(
                "throttled_gpus", float(throttled.size), note="NVML clocks down or throttle reason"
            )
        )
        return (
            "GPU throttling",
            subjects,
            ev,
            f" ({throttled.size} GPU(s) on {', '.join(nodes[:4]) or 'unknown nodes'})",
        )
    note = f" (rank {subjects.ranks[0]})" if cause in _BLAMES and subjects.ranks else ""
    return _LABELS.get(cause, cause), subjects, ev, note


def holds_up_most(values: robust.FloatArray) -> int:
    """The column of rows [steps, ranks] that is, on average over the steps, furthest above
    each step's median: the rank that cost the job most. A straggler slow at every step is;
    so is an intermittent one (2x every 4th step: its median over the steps is normal, which
    named a rank of one hiccup) and a ramp's, while one hiccup is diluted by the other steps."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a column with no value: NaN
        excess = np.nanmean(values - robust.nanmedian(values, 1, keepdims=True), axis=0)
    finite = np.isfinite(excess)
    return int(np.argmax(np.where(finite, excess, -np.inf))) if finite.any() else 0


# The cause named must account for this share of the step time's growth that the drop implies
# (its parts' growth: means over the steps before and after the change); below it, none does.
# In a 64-rank job a 1.25x straggler in backward did not move the max over ranks of compute,
# which jitter sets at every step, and a communication growth of 0.2 % of the step was named
# the cause of its 8 %.
EXPLAINED_SHARE = 0.25
# How a drop's summary says that no part of step time grew by `EXPLAINED_SHARE` of it.
UNCLEAR_LABEL = "cause unclear (no part of the step time grew by a quarter of its growth)"
_IMBALANCE = "sequence-length imbalance"
_STRAGGLER = "a straggler"
# One rank's data loading (its data time's max over ranks grew, the median did not): the job
# waits for that rank's loader as for a straggler.
_RANK_DATA = "a rank's data loading"
# How a summary names each cause (others: as they are).
_LABELS = {
    "data loading": "data stall",
    _RANK_DATA: "data stall",
    "communication": "communication slowdown",
    "compute on every rank": "compute slowdown on every rank",
}
# Causes that name one rank, and the kind of finding that names it for the same cause.
_BLAMES = {_STRAGGLER: schema.FindingKind.STRAGGLER, _RANK_DATA: schema.FindingKind.DATA_STALL}


def blamed(drop: schema.Finding) -> tuple[int, schema.FindingKind] | None:
    """The rank an MFU-drop finding blames (as a straggler, or for its data loading) and the
    kind of finding that would name it for the same cause; None: another cause."""
    ranks = drop.subjects.ranks
    if drop.kind is not schema.FindingKind.MFU_DROP or len(ranks) != 1:
        return None
    for cause, kind in _BLAMES.items():
        if f": {_LABELS.get(cause, cause)} (rank {ranks[0]})" in drop.summary:
            return ranks[0], kind
    return None


def explains(finding: schema.Finding, drop: schema.Finding, slack_steps: int) -> bool:
    """Whether `finding`, over steps that reach within `slack_steps` of the MFU drop's, is
    that drop's cause: a straggler or data-stall finding naming the rank the drop blames for
    the same cause; a slow link, for a drop blamed on communication; any of the three, for a
    drop no part of step time explains (a straggler among many ranks, whose compute the max
    over ranks does not show)."""
    if drop.kind is not schema.FindingKind.MFU_DROP or not (
        finding.step_start <= drop.step_end + slack_steps
        and drop.step_start <= finding.step_end + slack_steps
    ):
        return False
    rank_kind = blamed(drop)
    if rank_kind is not None:
        return finding.kind is rank_kind[1] and finding.subjects.ranks == [rank_kind[0]]
    if _says(drop, _LABELS["communication"]):
        return finding.kind is schema.FindingKind.SLOW_LINK
    return _says(drop, UNCLEAR_LABEL) and finding.kind in _CAUSES


# The findings an unexplained drop may be folded into.
_CAUSES = (
    schema.FindingKind.STRAGGLER,
    schema.FindingKind.DATA_STALL,
    schema.FindingKind.SLOW_LINK,
)


def _says(drop: schema.Finding, label: str) -> bool:
    """Whether the drop's summary gives the cause `label` (as `_LABELS` words causes)."""
    return f": {label}" in drop.summary


def folded(straggler: schema.Finding, drop: schema.Finding) -> schema.Finding:
    """`straggler` (or the data-stall or slow-link finding that explains the drop) with the
    drop's headline evidence added (once)."""
    head = drop.evidence[0]
    note = f"job {head.metric} from step {drop.step_start} ({head.note})"
    if any(e.metric == head.metric for e in straggler.evidence):
        return straggler
    extra = findings.evidence(head.metric, head.observed, head.baseline, note=note)
    return msgspec.structs.replace(straggler, evidence=[*straggler.evidence, extra])


def fold(found: list[schema.Finding], slack_steps: int) -> list[schema.Finding]:
    """`found` without the MFU drops another finding among them explains (`explains`), each
    folded into that finding as evidence (order kept otherwise)."""
    out = list(found)
    for drop in [f for f in found if f.kind is schema.FindingKind.MFU_DROP]:
        for i, f in enumerate(out):
            if explains(f, drop, slack_steps):
                out[i] = folded(f, drop)
                out.remove(drop)
                break
    return out


def token_weighed(compute: robust.FloatArray, tokens: robust.FloatArray) -> robust.FloatArray:
    """Each rank's compute per token times its step's median tokens (seconds, comparable across
    ranks whatever their share of tokens); `compute` itself when tokens are not known or do not
    vary. Entries without tokens keep their raw compute."""
    finite = tokens[np.isfinite(tokens) & (tokens > 0)]
    if not finite.size or float(finite.max()) == float(finite.min()):
        return compute
    with np.errstate(all="ignore"):
        counted = np.where(tokens > 0, tokens, np.nan)
        median = np.nanmedian(counted, axis=1, keepdims=True)
        weighed = compute * (median / counted)
    out: robust.FloatArray = np.where(np.isfinite(weighed), weighed, compute).astype(compute.dtype)
    return out


def _imbalance(
    a: arrays_mod.StepArrays, before: slice, after: slice, ev: list[schema.Evidence]
) -> tuple[str, schema.Subjects, list[schema.Evidence], str]:
    """The drop follows tokens: the job's finding (no rank to blame), naming the busiest rank."""
    with np.errstate(all="ignore"):
        tokens = np.nanmedian(a.tokens[after], axis=0)
        baseline = float(np.nanmedian(a.tokens[before]))
    col = int(np.nanargmax(tokens))
    most, median = float(tokens[col]), float(np.nanmedian(tokens))
    ev.append(findings.evidence("max_tokens", most, median, note="busiest rank vs the median"))
    share = f"{most / median:.2g}x" if median > 0 else "more"
    note = (
        f" (rank {int(a.ranks[col])} has {share} the median tokens; tokens per rank were "
        f"{baseline:.0f} before)"
    )
    return _IMBALANCE, schema.Subjects(), ev, note


def _throttled_columns(
    a: arrays_mod.StepArrays, before: slice, after: slice
) -> npt.NDArray[np.intp]:
    hit = np.zeros(a.num_ranks, dtype=bool)
    if a.throttled is not None:
        hit |= np.nanmax(a.throttled[after], axis=0, initial=0.0) > 0
    if a.sm_clock_hz is not None:
        with np.errstate(all="ignore"):
            x = np.nanmedian(a.sm_clock_hz[before], axis=0)
            y = np.nanmedian(a.sm_clock_hz[after], axis=0)
        hit |= np.nan_to_num(y / x, nan=1.0) < 0.95
    return np.flatnonzero(hit)
