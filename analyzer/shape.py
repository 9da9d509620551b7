"""How a straggler's excess is spread over its episode: steady, intermittent or growing.

A finding's headline is the rank's median over the episode's steps, which says what most steps
looked like. Two common faults hide behind it: a rank slow only in some steps (a periodic job on
its host, a garbage-collection pause every N steps, an uneven data shard) reads as a few percent
over its peers, and a rank slowing step after step (a leak, a throttling GPU) reads as its
average. `of` reads the per-step ratios of the rank's value to its peers' median, and its
excess over them as a share of the step, and says which; `phrase` and `evidence` put it in the
finding:

- growing: a robust line (Theil-Sen) through the excess shares ends at least `EXCESS_GROWTH` x
  as high as it starts, and the shares rise in order (Kendall's tau at least `MIN_TAU`: ~3
  standard deviations of a trendless 30-step episode's tau). Shares, not ratios: where the
  rank's value is a small part of its step (a plain loop's or a pipeline stage's compute) the
  peers' median, a few ms, swings the ratio by a factor of 2-3 from step to step, and real
  1 %/step ramps there read steady;
- intermittent: at least `MIN_SLOW_STEPS` steps, at most half of them, at `SLOW_RATIO` x the
  peers' median or more and `SLOW_SPREADS` robust spreads above the episode's median, while the
  other steps' median stays below `SLOW_RATIO` x (or within `OTHER_SHARE` of a step of the
  peers') and the slow steps carry `SLOW_SHARE` of the
  rank's whole excess (a steady straggler's noisy steps carry a small part of it); with a
  period when `PERIOD_SHARE` of the slow steps fall on one phase of it and that phase's steps
  are that share slow;
- steady: anything else, and any episode too short to tell.

The thresholds were read off real 4-rank gloo jobs (`bench/faults.py`, 5 wrappers, 8 matrices,
and three CI runs of `tests/realjobs/test_detection.py`: 481 of 481 steady stragglers and
stalls read steady; 37 of 39 intermittent ones and 35 of 39 ramps were named, the rest steady;
a line through the ratios had named 30 of those ramps, one of them a pipeline's that the
shares read steady).
Pure numpy. A shape describes a finding and never decides whether there is one, but for
letting an intermittent one's median stay at its peers' (`stragglers._moved_up`); `period` is
also the test behind `excess.py`'s period evidence.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vigil import schema
from vigil.analyzer import findings, robust

# Growing: the fitted excess share at the last step at least this many times the first's (a
# steady 2x pipeline stage drifted from 4.3x to 5.6x its peers, in order: excess x1.4; real
# 1 %/step ramps' excess grew 2.2-10x over their episodes) ...
EXCESS_GROWTH = 2.0
# ... and Kendall's tau of the shares against the step order.
MIN_TAU = 0.4
# Intermittent: the slow steps (a hiccup or two is not a pattern) ...
MIN_SLOW_STEPS = 3
SLOW_RATIO = 1.5
SLOW_SPREADS = 4.0
# ... carry this share of the rank's excess over its peers, while its other steps are at the
# peers' level: below `SLOW_RATIO` x their median, or within this share of a step of it (where
# the rank's value is a small part of its step, a real plain loop's other steps read 1.7x its
# peers' few ms, 3 % of a step).
SLOW_SHARE = 2 / 3
OTHER_SHARE = 0.04
# A period: this share of the slow steps on one phase, and of that phase's steps slow.
PERIOD_SHARE = 0.75
MAX_PERIOD = 16
# Theil-Sen over the last this many steps at most (pairs grow as the square).
MAX_TREND_STEPS = 256
# The evidence each shape writes (`evidence`), by which a finding says it (`said`).
SLOW_STEPS_METRIC = "slow_steps"
TREND_METRIC = "trend"


class Kind(enum.StrEnum):
    STEADY = "steady"
    INTERMITTENT = "intermittent"
    GROWING = "growing"


@dataclass(frozen=True, kw_only=True)
class Shape:
    """An episode's shape: its kind, the steps it was read from, and the kind's own figures."""

    kind: Kind
    num_steps: int
    # Intermittent: how many steps were slow, every `period`-th (0: no period), and the median
    # ratio of the slow steps and of the others.
    num_slow: int = 0
    period: int = 0
    slow_ratio: float = float("nan")
    other_ratio: float = float("nan")
    # Growing: the fitted excess share at the episode's first and last step, and Kendall's tau.
    start_share: float = float("nan")
    end_share: float = float("nan")
    tau: float = float("nan")


def of(ratios: robust.FloatArray, shares: robust.FloatArray) -> Shape:
    """The shape of one rank's episode from its per-step ratios to its peers' median and its
    excess over that median as a share of the step's median step time (NaN: not known that
    step)."""
    r, e = np.asarray(ratios, dtype=np.float64), np.asarray(shares, dtype=np.float64)
    steps = np.flatnonzero(np.isfinite(r) & np.isfinite(e))
    r, e = r[steps], e[steps]
    if r.size < 2 * MIN_SLOW_STEPS:
        return Shape(kind=Kind.STEADY, num_steps=int(r.size))
    grown = _growing(steps, e)
    if grown is not None:
        return grown
    return _intermittent(steps, r, e) or Shape(kind=Kind.STEADY, num_steps=int(r.size))


def _growing(steps: np.ndarray, e: np.ndarray) -> Shape | None:
    x, y = steps[-MAX_TREND_STEPS:].astype(np.float64), e[-MAX_TREND_STEPS:]
    i, j = np.triu_indices(y.size, 1)
    dx, dy = x[j] - x[i], y[j] - y[i]
    tau = float(np.mean(np.sign(dy)))
    slope = float(np.median(dy / dx))
    intercept = float(np.median(y - slope * x))
    start, end = intercept + slope * x[0], intercept + slope * x[-1]
    # A steady straggler's excess drifting up by a share of itself is not growth.
    if tau < MIN_TAU or end <= 0 or end < EXCESS_GROWTH * start:
        return None
    return Shape(
        kind=Kind.GROWING, num_steps=int(y.size), start_share=start, end_share=end, tau=tau
    )


def _intermittent(steps: np.ndarray, r: np.ndarray, e: np.ndarray) -> Shape | None:
    median = float(np.median(r))
    spread = robust.MAD_TO_SIGMA * float(np.median(np.abs(r - median)))
    slow = (r >= SLOW_RATIO) & (r >= median + SLOW_SPREADS * spread)
    num_slow = int(slow.sum())
    if num_slow < MIN_SLOW_STEPS or num_slow > r.size // 2:
        return None
    excess = np.clip(r - 1.0, 0.0, None)
    other = float(np.median(r[~slow]))
    slow_otherwise = other >= SLOW_RATIO and float(np.median(e[~slow])) >= OTHER_SHARE
    if slow_otherwise or excess[slow].sum() < SLOW_SHARE * excess.sum():
        return None  # slow in every step, or the slow steps are a steady straggler's noise
    return Shape(
        kind=Kind.INTERMITTENT,
        num_steps=int(r.size),
        num_slow=num_slow,
        period=period(steps, slow),
        slow_ratio=float(np.median(r[slow])),
        other_ratio=other,
    )


def period(steps: np.ndarray, slow: np.ndarray) -> int:
    """The shortest period (2..`MAX_PERIOD`) one phase of which holds `PERIOD_SHARE` of the
    `slow` steps (at least `MIN_SLOW_STEPS`) while that share of its own steps are slow: for
    each of `steps` (ascending step numbers) whether it was slow; 0: none."""
    at = steps[slow]
    for every in range(2, MAX_PERIOD + 1):
        phases = np.bincount(at % every, minlength=every)
        phase = int(np.argmax(phases))
        on_phase = steps % every == phase
        if phases[phase] < MIN_SLOW_STEPS or phases[phase] < PERIOD_SHARE * at.size:
            continue
        if phases[phase] >= PERIOD_SHARE * int(on_phase.sum()):
            return every
    return 0


def said(evidence: Sequence[schema.Evidence]) -> Kind:
    """The shape a finding's evidence says (`evidence` wrote it)."""
    metrics = {e.metric for e in evidence}
    if SLOW_STEPS_METRIC in metrics:
        return Kind.INTERMITTENT
    return Kind.GROWING if TREND_METRIC in metrics else Kind.STEADY


# What a shape's ratios were taken against: the peers' median, or (a forward shift,
# `forward_shift.py`) the rank's own earlier steps.
PEERS = ("its peers' median", "its peers")
OWN = ("its own earlier level", "its own earlier level")


def phrase(s: Shape, label: str, against: tuple[str, str] = PEERS) -> str:
    """How the finding's summary says the shape, after its headline (an intermittent one's
    replaces the median, which is what its usual steps look like): `label` is the headline's
    metric (`compute_time`), `against` what its ratios were taken against (`PEERS`, `OWN`);
    '' for a steady episode (the median says it)."""
    if s.kind is Kind.INTERMITTENT:
        every = f"every {ordinal(s.period)} step; " if s.period else ""
        return (
            f", {label} {s.slow_ratio:.2f}x {against[0]} in {s.num_slow} of {s.num_steps} "
            f"steps ({every}{s.other_ratio:.2f}x in the others)"
        )
    if s.kind is Kind.GROWING:
        return (
            f", its excess over {against[1]} growing from {_percent(s.start_share)} to "
            f"{_percent(s.end_share)} of a step"
        )
    return ""


def _percent(share: float) -> str:
    return f"{100 * share:.0f} %" if abs(share) >= 0.095 else f"{100 * share:.1f} %"


def evidence(s: Shape, against: tuple[str, str] = PEERS) -> list[schema.Evidence]:
    """The shape's own numbers, as a finding's evidence (none for a steady episode)."""
    if s.kind is Kind.INTERMITTENT:
        every = f" (every {ordinal(s.period)} step)" if s.period else ""
        return [
            findings.evidence(
                SLOW_STEPS_METRIC,
                s.num_slow,
                s.num_steps,
                note=f"steps at {SLOW_RATIO}x {against[0]} or more / the episode's "
                f"steps{every}; those at {s.slow_ratio:.2f}x, the others at {s.other_ratio:.2f}x",
            )
        ]
    if s.kind is Kind.GROWING:
        return [
            findings.evidence(
                TREND_METRIC,
                s.end_share,
                s.start_share,
                note=f"its excess over {against[0]} as a share of the step's median step "
                "time at the episode's last vs first step (Theil-Sen line; Kendall tau "
                f"{s.tau:.2f})",
            )
        ]
    return []


def ordinal(n: int) -> str:
    """`4th`, `2nd`, `11th`."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
