"""Straggler detection: compute-vs-wait decomposition, robust per-step scores and persistence.

In synchronous training the slow rank arrives last at each collective and waits least, so step time
cannot tell it apart; compute time (step minus exposed communication wait minus data time) can.
Every step, each rank's compute, data-loading and transfer time (averaged over its last
`smooth_steps` steps, the largest left out) is scored against the other ranks (median/MAD,
within its pipeline stage when there is one); a rank flagged in `min_hits` of the last `window`
steps is reported. Causes are told apart: compute stragglers (with GPU throttling noted from
NVML clocks), data-loader stalls, slow links (transfer time up for the ranks of one node or two;
one rank's transfer time up while its compute is an outlier too is the straggler), and compute
that only follows a larger share of tokens (sequence-length imbalance, reported for the job
rather than the rank). Pipeline-stage imbalance lives in `imbalance.py`. Pure numpy over
`StepArrays`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import findings, groups, robust

Kind = schema.FindingKind


@dataclass(kw_only=True)
class Scores:
    """Outlier flags, z-scores and per-step medians of each signal, shaped [steps, ranks]."""

    compute: robust.BoolArray
    compute_z: robust.FloatArray
    compute_med: robust.FloatArray
    data: robust.BoolArray
    data_z: robust.FloatArray
    transfer: robust.BoolArray
    transfer_z: robust.FloatArray
    seqlen_explained: robust.BoolArray

    def rows(self, start: int, stop: int) -> Scores:
        """The scores of rows [start, stop) (views, not copies)."""
        return Scores(
            **{f.name: getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)}
        )

    def flags(self, kind: schema.FindingKind) -> robust.BoolArray:
        return {
            Kind.STRAGGLER: self.compute,
            Kind.DATA_STALL: self.data,
            Kind.SLOW_LINK: self.transfer,
        }[kind]

    def z(self, kind: schema.FindingKind) -> robust.FloatArray:
        return {
            Kind.STRAGGLER: self.compute_z,
            Kind.DATA_STALL: self.data_z,
            Kind.SLOW_LINK: self.transfer_z,
        }[kind]


RANK_KINDS = (Kind.STRAGGLER, Kind.DATA_STALL, Kind.SLOW_LINK)


def score(a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig, *, last: int = 0) -> Scores:
    """Score the steps of `a` (all, or only the `last` rows; earlier rows still feed smoothing)."""
    z, excess, floor = cfg.z_threshold, cfg.min_excess, cfg.scale_floor
    rows = slice(-last, None) if last else slice(None)

    def smooth(values: robust.FloatArray) -> robust.FloatArray:
        if last == 1:
            return robust.trimmed_mean_last(values, cfg.smooth_steps)
        return robust.rolling_trimmed_mean(values, cfg.smooth_steps)[rows]

    # Each step's median step time: a rank counts as slow by the share of the step it costs.
    step_time = robust.nanmedian(smooth(a.step_time_s), 1, keepdims=True)

    def outliers(
        values: robust.FloatArray,
        groups: npt.NDArray[np.int32] | None = None,
        reference: robust.FloatArray | None = step_time,
    ) -> tuple[robust.BoolArray, robust.FloatArray, robust.FloatArray]:
        return robust.high_outliers(
            values,
            z_threshold=z,
            min_excess=excess,
            scale_floor=floor,
            groups=groups,
            reference=reference,
        )

    stages = _stage_groups(a.stages)
    compute = smooth(a.compute_s())
    c_flags, c_z, c_med = outliers(compute, stages)
    explained = np.zeros_like(c_flags)
    if c_flags.any() and _tokens_vary(a.tokens):
        tokens = smooth(a.tokens)
        t_flags, _, _ = outliers(tokens, stages, reference=None)  # tokens: by their own median
        with np.errstate(all="ignore"):
            per_token = compute / np.where(tokens > 0, tokens, np.nan)
        p_flags, _, _ = outliers(per_token, stages, reference=None)
        explained = c_flags & t_flags & ~p_flags
        c_flags = c_flags & ~explained
    data = smooth(a.data_s)
    d_flags, d_z, _ = outliers(data)
    with np.errstate(invalid="ignore"):
        d_flags &= data > cfg.min_data_share * a.step_time_s[rows]
    if np.isfinite(a.transfer_s).any():
        # A link is slow by its own ratio (transfer time is shared by a group's members, so
        # one rank's compute or waiting never moves it).
        x_flags, x_z, _ = outliers(smooth(a.transfer_s), reference=None)
    else:
        x_flags, x_z = np.zeros_like(c_flags), np.zeros_like(c_z)
    # A rank slowed by its own data loader is not also a compute straggler.
    return Scores(
        compute=c_flags & ~d_flags,
        compute_z=c_z,
        compute_med=c_med,
        data=d_flags,
        data_z=d_z,
        transfer=x_flags,
        transfer_z=x_z,
        seqlen_explained=explained,
    )


def _stage_groups(stages: npt.NDArray[np.int32] | None) -> npt.NDArray[np.int32] | None:
    """Pipeline stages to score within, when each has enough ranks for a robust median (3);
    stages of one or two ranks are scored together (their compute is meant to be balanced)."""
    if stages is None or stages.size == 0:
        return None
    _, counts = np.unique(stages, return_counts=True)
    return stages if int(counts.min()) >= 3 else None


def _tokens_vary(tokens: robust.FloatArray) -> bool:
    finite = tokens[np.isfinite(tokens)]
    return bool(finite.size) and float(finite.max()) > float(finite.min())


def detect(
    a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig, scores: Scores | None = None
) -> list[schema.Finding]:
    """Every persistent straggler, data stall and slow link in `a`."""
    scores = scores or score(a, cfg)
    out: list[schema.Finding] = []
    link_episodes: list[tuple[int, int, int, int]] = []
    for kind in RANK_KINDS:
        flags = scores.flags(kind)
        hits = robust.rolling_hits(flags, cfg.window)
        for col in np.flatnonzero((hits >= cfg.min_hits).any(axis=0)):
            for first, last, at in robust.persistent_episodes(
                flags[:, col], hits[:, col], cfg.min_hits
            ):
                if kind is Kind.SLOW_LINK:
                    link_episodes.append((int(col), first, last, at))
                else:
                    out.append(rank_finding(a, scores, kind, int(col), first, last, at, cfg))
    out.extend(link_findings(a, scores, link_episodes, cfg))
    return [f for f in out if _moved_up(f, cfg)]


def _moved_up(finding: schema.Finding, cfg: config_mod.StragglerConfig) -> bool:
    """Whether the finding's own headline evidence shows the metric up by the minimum excess
    (flags come from smoothed per-step scores; an episode whose median over its steps is not
    above the baseline is not reported: its evidence would contradict it)."""
    head = finding.evidence[0]
    if head.baseline is None or head.baseline <= 0:
        return head.observed > 0
    return head.observed > head.baseline * (1.0 + cfg.min_excess / 2)


def rank_finding(
    a: arrays_mod.StepArrays,
    scores: Scores,
    kind: schema.FindingKind,
    col: int,
    first: int,
    last: int,
    at: int,
    cfg: config_mod.StragglerConfig,
) -> schema.Finding:
    """A finding about one rank's episode over rows first..last (detected at row `at`)."""
    rows = slice(first, last + 1)
    rank = int(a.ranks[col])
    flags = scores.flags(kind)[rows, col]
    z = float(np.nanmedian(scores.z(kind)[rows, col][flags])) if flags.any() else 0.0
    values, label = _signal(a, kind)
    observed = float(np.nanmedian(values[rows, col]))
    with np.errstate(all="ignore"):
        baseline = float(np.nanmedian(np.nanmedian(values[rows], axis=1)))
    ev = [
        findings.evidence(
            label, observed, baseline, unit="s", note=f"median over steps; robust z {z:.1f}"
        ),
        findings.evidence(
            "outlier_steps",
            int(flags.sum()),
            float(last - first + 1),
            note="flagged / steps in range",
        ),
    ]
    note = ""
    if kind is Kind.STRAGGLER:
        ev.extend(_arrival_evidence(a, rows, col))
        note = _throttle_note(a, rows, col, ev)
    ratio = observed / baseline if baseline > 0 else float("inf")
    node = a.nodes[col]
    what = {
        Kind.STRAGGLER: "compute straggler",
        Kind.DATA_STALL: "data-loader stall",
        Kind.SLOW_LINK: "slow link",
    }[kind]
    summary = (
        f"rank {rank}{f' on {node}' if node else ''}: {what}, {label} {ratio:.2f}x the median{note}"
        + (_held_up(a, col) if kind is Kind.STRAGGLER else "")
    )
    return findings.make_finding(
        kind=kind,
        job_id=a.job_id,
        subjects=schema.Subjects(
            ranks=[rank],
            nodes=[node] if node else [],
            devices=[a.devices[col]] if a.devices and a.devices[col] else [],
        ),
        step_start=int(a.steps[first]),
        step_end=int(a.steps[last]),
        summary=summary,
        evidence=ev,
        confidence=findings.confidence_from_z(z, int(flags.sum()), cfg.window)
        + (0.05 if note else 0.0),
        detected_s=_time_at(a, at),
        trace_start_s=_time_at(a, first, start=True),
        trace_end_s=_time_at(a, last),
    )


def _held_up(a: arrays_mod.StepArrays, col: int) -> str:
    """`; it holds up the tp group of node-1 (ranks 2, 3)`: the straggler's labelled groups."""
    if a.aggs is None or not len(a.aggs) or not a.agg_keys:
        return ""
    held = groups.held_up(a.agg_keys, a.aggs.key, a.aggs.col, col)
    if not held:
        return ""
    described = [
        groups.describe(name, [int(a.ranks[c]) for c in cols], [a.nodes[c] for c in cols])
        for name, cols in held
    ]
    return "; it holds up " + " and ".join(described)


def _signal(a: arrays_mod.StepArrays, kind: schema.FindingKind) -> tuple[robust.FloatArray, str]:
    if kind is Kind.STRAGGLER:
        return a.compute_s(), "compute_time"
    if kind is Kind.DATA_STALL:
        return a.data_s, "data_time"
    return a.transfer_s, "collective_transfer_time"


def _time_at(a: arrays_mod.StepArrays, row: int, *, start: bool = False) -> float:
    value = (a.step_start_s if start else a.step_end_s)[row]
    return float(value) if np.isfinite(value) else 0.0


def _arrival_evidence(a: arrays_mod.StepArrays, rows: slice, col: int) -> list[schema.Evidence]:
    """Arrival order at the step's collectives: the straggler arrives last and waits least."""
    arrival = (a.data_s[rows] + a.compute_s()[rows]).astype(np.float64)
    arrival = np.where(np.isfinite(arrival), arrival, -np.inf)
    last_share = float(np.mean(np.argmax(arrival, axis=1) == col))
    wait = float(np.nanmedian(a.comm_wait_s[rows, col]))
    with np.errstate(all="ignore"):
        wait_med = float(np.nanmedian(np.nanmedian(a.comm_wait_s[rows], axis=1)))
    return [
        findings.evidence(
            "arrived_last_share",
            last_share,
            1.0 / max(1, a.num_ranks),
            note="share of steps this rank reached the collective last",
        ),
        findings.evidence(
            "comm_wait_time", wait, wait_med, unit="s", note="the straggler waits least"
        ),
    ]


def _throttle_note(
    a: arrays_mod.StepArrays, rows: slice, col: int, ev: list[schema.Evidence]
) -> str:
    """Add NVML clock evidence when the rank's GPU ran slower than its peers'."""
    if a.sm_clock_hz is None:
        return ""
    with np.errstate(all="ignore"):
        mine = float(np.nanmedian(a.sm_clock_hz[rows, col]))
        peers = float(np.nanmedian(a.sm_clock_hz[rows]))
    throttled = a.throttled is not None and bool(np.nanmax(a.throttled[rows, col]) > 0)
    if not (np.isfinite(mine) and np.isfinite(peers)) or (mine >= 0.97 * peers and not throttled):
        return ""
    ev.append(findings.evidence("sm_clock", mine, peers, unit="Hz", note="NVML SM clock vs peers"))
    return (
        "; GPU throttled (SM clock "
        + f"{mine / peers:.0%} of peers"
        + (", NVML throttle reason active)" if throttled else ")")
    )


def link_findings(
    a: arrays_mod.StepArrays,
    scores: Scores,
    episodes: Sequence[tuple[int, int, int, int]],
    cfg: config_mod.StragglerConfig,
) -> list[schema.Finding]:
    """Group ranks whose transfer time is persistently up by node: one finding per link or node."""
    if not episodes:
        return []
    by_node: dict[str, list[tuple[int, int, int, int]]] = {}
    for ep in episodes:
        by_node.setdefault(a.nodes[ep[0]] or f"rank{a.ranks[ep[0]]}", []).append(ep)
    node_sizes: dict[str, int] = {}
    for name in a.nodes:
        node_sizes[name] = node_sizes.get(name, 0) + 1
    covered = sorted(
        n
        for n, eps in by_node.items()
        if len({e[0] for e in eps}) >= cfg.node_coverage * node_sizes.get(n, 1)
    )
    out = []
    if covered:
        eps = [e for n in covered for e in by_node[n]]
        links = (
            [f"{x}<->{y}" for x, y in itertools.combinations(covered, 2)]
            if len(covered) == 2
            else []
        )
        out.append(_link_finding(a, scores, eps, covered, links, cfg))
    for name in sorted(set(by_node) - set(covered)):
        # One rank's transfer time up while its compute is an outlier too is the straggler
        # seen from the collectives (a starved process is slow at everything), not its link.
        alone = [e for e in by_node[name] if not _compute_explains(scores, *e[:3])]
        if alone:
            out.append(rank_finding(a, scores, Kind.SLOW_LINK, *alone[0], cfg))
    return out


def _compute_explains(scores: Scores, col: int, first: int, last: int) -> bool:
    """Whether `col`'s compute was an outlier in at least half the rows first..last."""
    flags = scores.compute[first : last + 1, col]
    return bool(flags.size) and float(flags.mean()) >= 0.5


def _link_finding(
    a: arrays_mod.StepArrays,
    scores: Scores,
    eps: Sequence[tuple[int, int, int, int]],
    nodes: list[str],
    links: list[str],
    cfg: config_mod.StragglerConfig,
) -> schema.Finding:
    cols = sorted({e[0] for e in eps})
    first, last, at = min(e[1] for e in eps), max(e[2] for e in eps), min(e[3] for e in eps)
    rows = slice(first, last + 1)
    with np.errstate(all="ignore"):
        observed = float(np.nanmedian(a.transfer_s[rows][:, cols]))
        baseline = float(np.nanmedian(np.nanmedian(a.transfer_s[rows], axis=1)))
        z = float(np.nanmedian(scores.transfer_z[rows][:, cols]))
    where = " <-> ".join(nodes) if links else ", ".join(nodes)
    return findings.make_finding(
        kind=Kind.SLOW_LINK,
        job_id=a.job_id,
        subjects=schema.Subjects(ranks=[int(a.ranks[c]) for c in cols], nodes=nodes, links=links),
        step_start=int(a.steps[first]),
        step_end=int(a.steps[last]),
        summary=(
            f"slow link {where}: collective transfer time "
            f"{observed / max(baseline, 1e-12):.2f}x the median on {len(cols)} rank(s)"
        ),
        evidence=[
            findings.evidence(
                "collective_transfer_time", observed, baseline, unit="s", note=f"robust z {z:.1f}"
            ),
            findings.evidence("ranks_affected", len(cols)),
        ],
        confidence=findings.confidence_from_z(z, cfg.window, cfg.window),
        detected_s=_time_at(a, at),
        trace_start_s=_time_at(a, first, start=True),
        trace_end_s=_time_at(a, last),
    )
