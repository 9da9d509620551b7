"""Straggler detection: compute-vs-wait decomposition, robust per-step scores and persistence.

In synchronous training the slow rank arrives last at each collective and waits least, so step time
cannot tell it apart; compute time (step minus exposed communication wait, data time and wait for
a CPU; unknown where that wait overlapped the communication wait, `StepArrays.known_compute_s`)
can.
Every step, each rank's compute and data-loading time (averaged over its last `smooth_steps` steps,
the largest left out) is scored against the other ranks (median/MAD, within its pipeline stage when
it has 3 ranks or more; smaller stages are scored together, and there a stage slow as a whole is
its imbalance, not its ranks' fault; a group of fewer than `scale_samples` ranks takes its scale
over its last few steps, and there compute high at `small_group_z` counts where its ranks do the
same work, and at `corroborated_z` when the rank's wait is as low); a rank flagged in
`min_hits` of the last `window` steps is reported, a compute straggler once its unsmoothed
steps also carry the evidence (`excess.py`: a CUSUM of its excess over its peers' median, so a
clean rank's short run of high jitter is not one, or its slow steps' period), or flagged in
`strong_hits` of them once they carry `strong_evidence` times as much; a job's first
`warmup_steps` steps (start-up) flag nothing. Causes are told apart: compute
stragglers (with GPU throttling noted from NVML clocks), data-loader stalls, and compute that
only follows a larger share of tokens (sequence-length imbalance, reported for the job rather
than the rank).
A flagged rank must also hold its peers up: its smoothed communication wait may not exceed its
peers' median (a straggler arrives last and waits least); a rank flagged for CPU wait must also be
late, its compute plus that wait an outlier as compute is.
Pipeline-stage imbalance lives in `imbalance.py`; slow links in `links.py`, which compares process
groups with their peer groups.
No rank is judged by its own transfer time: it is its groups' (attribution.py, the shortest
member's), summed over groups of different kinds, so one rank's total is up whenever it belongs to
a slow group or to more groups than its peers (a pipeline stage's p2p, a straggler's tp group),
not because its link is slow (on simulated jobs every rank- and node-level slow-link finding
this module used to make named a wrong rank). Pure numpy over `StepArrays`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import excess, findings, forward_shift, groups, imbalance, robust, shape

Kind = schema.FindingKind


@dataclass(kw_only=True)
class Scores:
    """Outlier flags, z-scores and per-step medians of each signal, shaped [steps, ranks]."""

    compute: robust.BoolArray
    compute_z: robust.FloatArray
    compute_med: robust.FloatArray
    data: robust.BoolArray
    data_z: robust.FloatArray
    seqlen_explained: robust.BoolArray
    # A rank waiting for a CPU far longer than its peers (another process on its host takes its
    # CPU time): a straggler too, whose cause is the host (`StepArrays.cpu_wait_s`).
    cpu: robust.BoolArray
    cpu_z: robust.FloatArray
    # A rank whose forward pass became slower than its own earlier steps while its peers' did
    # not (`forward_shift.py`): a compute straggler among ranks doing different work.
    forward: robust.BoolArray
    forward_z: robust.FloatArray
    # Which signal each cell's shift is (an index into `forward_shift.SIGNALS`: the forward
    # pass, a pipeline stage's own time outside its schedule or in its backward passes).
    signal: npt.NDArray[np.int8]

    @property
    def outside(self) -> robust.BoolArray:
        return forward_shift.is_signal(self.signal, forward_shift.OUTSIDE)

    @property
    def backward(self) -> robust.BoolArray:
        return forward_shift.is_signal(self.signal, forward_shift.BACKWARD)

    def rows(self, start: int, stop: int) -> Scores:
        """The scores of rows [start, stop) (views, not copies)."""
        return Scores(
            **{f.name: getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)}
        )

    def flags(self, kind: schema.FindingKind) -> robust.BoolArray:
        if kind is Kind.STRAGGLER:
            return self.compute | self.cpu | self.forward
        return self.data

    def z(self, kind: schema.FindingKind) -> robust.FloatArray:
        if kind is Kind.STRAGGLER:
            with np.errstate(invalid="ignore"):
                return np.fmax(np.fmax(self.compute_z, self.cpu_z), self.forward_z)
        return self.data_z


RANK_KINDS = (Kind.STRAGGLER, Kind.DATA_STALL)


def score(a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig, *, last: int = 0) -> Scores:
    """Score the steps of `a` (all, or only the `last` rows; earlier rows still feed smoothing)."""
    z, excess, floor = cfg.z_threshold, cfg.min_excess, cfg.scale_floor
    stages = stage_groups(a.stages)
    # Rows scored: the last `last` and the earlier ones their scales pool (robust.py).
    span = last + pooled_rows(a.num_ranks, stages, cfg) - 1 if last else 0
    rows = slice(-span, None) if span else slice(None)
    pool = {"min_samples": cfg.scale_samples, "max_rows": cfg.window}

    def smooth(values: robust.FloatArray) -> robust.FloatArray:
        if span == 1:
            return robust.trimmed_mean_last(values, cfg.smooth_steps)
        return robust.rolling_trimmed_mean(values, cfg.smooth_steps)[rows]

    # Each step's median step time: a rank counts as slow by the share of the step it costs.
    step_time = robust.nanmedian(smooth(a.step_time_s), 1, keepdims=True)

    def outliers(
        values: robust.FloatArray,
        groups: npt.NDArray[np.int32] | None = None,
        reference: robust.FloatArray | None = step_time,
        pooled: bool = True,
    ) -> tuple[robust.BoolArray, robust.FloatArray, robust.FloatArray]:
        return robust.high_outliers(
            values,
            z_threshold=z,
            min_excess=excess,
            scale_floor=floor,
            groups=groups,
            reference=reference,
            **(pool if pooled else {}),
        )

    compute = smooth(a.known_compute_s())
    c_flags, c_z, c_med = outliers(compute, stages)
    wait = smooth(a.comm_wait_s)
    # Ranks scored together that do different work (a pipeline's stages) are compared with
    # their own earlier steps below; their computes are no peers' at a lower bar.
    own = compares_own_forward(a.stages, sends_p2p=any(op == "p2p" for _, op in a.agg_keys))
    c_flags |= _small_group_outliers(
        compute, c_z, c_med, wait, stages, step_time, cfg, same_work=not own
    )
    c_flags &= ~_in_slow_stage(compute, a.stages, stages, step_time, cfg)
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
    if a.cpu_wait_s is not None and _reports_cpu_wait(a.cpu_wait_s):
        cpu_wait = smooth(a.cpu_wait_s)
        cpu_flags, cpu_z, _ = robust.high_outliers(
            cpu_wait,
            z_threshold=z,
            min_excess=cfg.min_cpu_wait_share,
            scale_floor=floor,
            reference=step_time,
        )  # each step's own scale (see StragglerConfig.scale_samples), as `late` below
        # ... and only when it makes the rank late: its compute plus that wait stands out as
        # compute does. A rank that waits for a CPU while a slow peer holds the job (its
        # wait then costs nothing: it would wait for that peer anyway) is no straggler.
        late, _, _ = outliers(
            smooth(a.compute_s() + np.nan_to_num(a.cpu_wait_s)), stages, pooled=False
        )
        cpu_flags &= late
    else:
        cpu_flags, cpu_z = np.zeros_like(c_flags), np.full_like(c_z, np.nan)
    # A straggler holds its peers up: they wait for it at the step's collectives and it waits
    # least. A rank whose compute or CPU wait only looks high (a measurement that double counts,
    # e.g. CPU wait spent inside an asynchronous collective) while it waits as long as its peers'
    # median, or longer, holds nobody up and is no straggler.
    center, _ = robust.robust_center_scale(wait, scale_floor=floor, groups=stages)
    with np.errstate(invalid="ignore"):
        held = ~(wait > center)  # NaN (no wait measured) does not clear a rank
    c_flags &= held
    cpu_flags &= held
    shifted = None
    if own:
        reference = _step_reference(a, cfg) if last else step_time  # every row's, once
        shifted = forward_shift.shift(a, reference, cfg)
    if shifted is None:
        f_flags, f_z = np.zeros_like(c_flags), np.full_like(c_z, np.nan)
        f_signal = np.zeros(c_flags.shape, dtype=np.int8)
    else:
        f_signal = shifted.signal[rows]
        # Its strength, for the finding's confidence: the shift in `min_shift`s, at the
        # outlier threshold where it is one.
        f_z = (shifted.share[rows] * (cfg.z_threshold / cfg.min_shift)).astype(c_z.dtype)
        f_flags = shifted.flags[rows] & held
    # A rank slowed by its own data loader is not also a compute straggler.
    scores = Scores(
        compute=c_flags & ~d_flags,
        compute_z=c_z,
        compute_med=c_med,
        data=d_flags,
        data_z=d_z,
        seqlen_explained=explained,
        cpu=cpu_flags & ~d_flags,
        cpu_z=cpu_z,
        forward=f_flags & ~d_flags,
        forward_z=f_z,
        signal=f_signal,
    )
    scored = c_z.shape[0]  # span, or fewer at a job's start
    return scores.rows(scored - last, scored) if scored > last > 0 else scores


def _step_reference(a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig) -> robust.FloatArray:
    """[steps, 1]: each step's median smoothed step time, over every row of `a`."""
    smoothed = robust.rolling_trimmed_mean(a.step_time_s, cfg.smooth_steps)
    return robust.nanmedian(smoothed, 1, keepdims=True)


def _small_group_outliers(
    compute: robust.FloatArray,
    compute_z: robust.FloatArray,
    compute_med: robust.FloatArray,
    wait: robust.FloatArray,
    stages: npt.NDArray[np.int32] | None,
    step_time: robust.FloatArray,
    cfg: config_mod.StragglerConfig,
    *,
    same_work: bool,
) -> robust.BoolArray:
    """Ranks of groups of fewer than `cfg.scale_samples` ranks whose compute is high (late by
    the minimum excess) short of `z_threshold`: at `cfg.small_group_z` alone where they do
    the same work (`same_work`: not a pipeline's stages scored together), or at
    `cfg.corroborated_z` while their communication wait is as far below their peers': both
    halves of a straggler's signature at once (it computes more and waits least). Not among
    thousands of ranks: there a rank's own steady speed reaches z 3.5, and z 3 on both
    readings at once (they move together)."""
    small = _group_sizes(stages, compute.shape[1]) < cfg.scale_samples
    if not small.any():
        return np.zeros(compute.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        late = compute - compute_med > cfg.min_excess * step_time
    alone = cfg.small_group_z if same_work else cfg.z_threshold
    high = late & (compute_z > alone)
    if cfg.corroborated_z < alone:
        low_wait, _, _ = robust.high_outliers(
            -wait,
            z_threshold=cfg.corroborated_z,
            min_excess=cfg.min_excess,
            scale_floor=cfg.scale_floor,
            groups=stages,
            reference=step_time,
            min_samples=cfg.scale_samples,
            max_rows=cfg.window,
        )
        with np.errstate(invalid="ignore"):
            high |= late & (compute_z > cfg.corroborated_z) & low_wait
    return high & small


def _in_slow_stage(
    compute: robust.FloatArray,
    all_stages: npt.NDArray[np.int32] | None,
    scored_stages: npt.NDArray[np.int32] | None,
    step_time: robust.FloatArray,
    cfg: config_mod.StragglerConfig,
) -> robust.BoolArray:
    """Columns whose pipeline stage computes more as a whole where stages are scored together
    (`stage_groups`: stages of two ranks): the stage's level (`imbalance.stage_levels`, what
    more than half its ranks reach) above the median stage's by the excess a straggler needs.
    That is the stage's imbalance (`imbalance.stage_findings`), not its ranks' fault. A stage
    of one rank is that rank: it stays a straggler."""
    if all_stages is None or scored_stages is not None:
        return np.zeros(compute.shape, dtype=bool)
    stage_ids, levels, center = imbalance.stage_levels(compute, all_stages)
    with np.errstate(invalid="ignore"):
        slow = levels - center > cfg.min_excess * step_time
    column_stage = np.searchsorted(stage_ids, all_stages)
    return slow[:, column_stage] & (_group_sizes(all_stages, compute.shape[1]) >= 2)


def _group_sizes(stages: npt.NDArray[np.int32] | None, num_ranks: int) -> npt.NDArray[np.int64]:
    """Each column's scoring group's size (all ranks, or its pipeline stage's)."""
    if stages is None:
        return np.full(num_ranks, num_ranks, dtype=np.int64)
    _, inverse, counts = np.unique(stages, return_inverse=True, return_counts=True)
    return np.asarray(counts[inverse], dtype=np.int64)


def pooled_rows(
    num_ranks: int, stages: npt.NDArray[np.int32] | None, cfg: config_mod.StragglerConfig
) -> int:
    """How many rows the scale of the smallest group scored together pools (`stages` as
    `stage_groups` returns them; see `robust.robust_center_scale`)."""
    smallest = num_ranks if stages is None else int(np.unique(stages, return_counts=True)[1].min())
    return robust.pool_rows(smallest, cfg.scale_samples, cfg.window)


def compares_own_forward(stages: npt.NDArray[np.int32] | None, *, sends_p2p: bool) -> bool:
    """Whether ranks scored together do different work, so that each rank's forward pass is
    compared with its own earlier steps (`forward_shift.py`): a pipeline's stages, declared
    (`Job.layout`) with fewer than 3 ranks a stage, or undeclared where ranks send each other
    point-to-point ops. Ranks of one stage, data-parallel or tensor-parallel peers do the same
    work, and their computes are compared with each other's."""
    if stage_groups(stages) is not None:
        return False
    return stages is not None or sends_p2p


def history_rows(
    num_ranks: int,
    stages: npt.NDArray[np.int32] | None,
    cfg: config_mod.StragglerConfig,
    *,
    own_forward: bool = False,
) -> int:
    """Rows before a step that scoring it reads (smoothing, pooled scales and, where ranks'
    forward passes are compared with their own, `own_forward`, forward shifts): a streaming
    analyzer that scores steps with this many earlier ones scores them as `vigil analyze`
    does."""
    pooled = cfg.smooth_steps + pooled_rows(num_ranks, stages, cfg) - 2
    return max(pooled, forward_shift.history_rows(cfg)) if own_forward else pooled


def stage_groups(stages: npt.NDArray[np.int32] | None) -> npt.NDArray[np.int32] | None:
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
    a: arrays_mod.StepArrays,
    cfg: config_mod.StragglerConfig,
    scores: Scores | None = None,
    *,
    warmup_rows: int | None = None,
    began_s: robust.FloatArray | None = None,
) -> list[schema.Finding]:
    """Every persistent straggler and data stall in `a`. Its first `warmup_rows` rows (default
    `cfg.warmup_steps`: `a` starts at the job's first step) are start-up and flag nothing.
    `began_s`: per column, when its straggler episode began where that was before `a`'s first
    row (a streaming window; NaN: unknown)."""
    scores = scores or score(a, cfg)
    skip = cfg.warmup_steps if warmup_rows is None else max(warmup_rows, 0)
    out: list[schema.Finding] = []
    x: robust.FloatArray | None = None  # excess.scores(a), once an episode needs them
    for kind in RANK_KINDS:
        flags = scores.flags(kind)
        if skip:
            flags = flags.copy()
            flags[:skip] = False
        hits = robust.rolling_hits(flags, cfg.window)
        need = persistence_hits(kind, cfg)
        for col in np.flatnonzero((hits >= need).any(axis=0)).tolist():
            for first, last, at in robust.persistent_episodes(flags[:, col], hits[:, col], need):
                extra: list[schema.Evidence] = []
                spread: shape.Shape | None = None  # the episode's shape, once read
                own: Own | None = None  # a shift's signal and its own earlier level
                # Where it was flagged in `min_hits` of `window` steps (None: only in
                # `strong_hits`, which only a steady compute straggler's evidence carries).
                full = _reached(hits[:, col], first, last, cfg.min_hits)
                if kind is Kind.STRAGGLER and _starved(a, scores, slice(first, last + 1), col):
                    if full is None:
                        continue
                    at = full
                    began = float(a.step_start_s[first])
                    if began_s is not None and col < began_s.size:
                        began = float(np.fmin(began, began_s[col]))  # NaN: unknown
                    lasted = _lasted(a, began, at, last, cfg.min_cpu_wait_episode_s)
                    if lasted is None:
                        continue
                    at = lasted
                elif kind is Kind.STRAGGLER and _shifted(scores, slice(first, last + 1), col):
                    # Its claim is its own change, against its peers' (forward_shift.py): its
                    # peers' compute, doing other work, is no yardstick for its evidence.
                    if full is None:
                        continue
                    at = full
                    own = _own_signal(a, scores, first, last, col, cfg)
                    if own is None:
                        continue
                    spread = _own_spread(a, slice(first, last + 1), col, own)
                elif kind is Kind.STRAGGLER:
                    if x is None:
                        x = excess.scores(a, stage_groups(a.stages), cfg)
                    # The evidence fits the claim: a steady straggler's rests on its usual
                    # steps, an intermittent one's on its recurring slow steps.
                    spread = _spread(a, kind, slice(first, last + 1), col)
                    steady = spread.kind is not shape.Kind.INTERMITTENT
                    accumulated = excess.accumulate(x[:, col : col + 1], cfg, steady=steady)
                    # Its evidence may come in any step it is still persistent in, flagged or
                    # not (an intermittent straggler's 6th slow step, between its flags).
                    carried = None
                    if full is not None:
                        held = _held_until(hits[:, col], last, cfg.min_hits)
                        carried = excess.evident(
                            a.steps, x[:, col], accumulated[:, 0], full, held, cfg, steady=steady
                        )
                    if steady:  # or in `strong_hits` of them, with more evidence
                        held = _held_until(hits[:, col], last, need)
                        strong = excess.strongly_evident(x[:, col], at, held, cfg, skip=skip)
                        if strong is not None and (carried is None or strong[0] < carried[0]):
                            carried = strong
                    if carried is None:
                        continue
                    at, evidence = carried
                    extra.append(evidence)
                    if at > last:
                        last = at
                        spread = _spread(a, kind, slice(first, last + 1), col)
                out.append(
                    rank_finding(
                        a, scores, kind, col, first, last, at, cfg, extra, spread=spread, own=own
                    )
                )
    return [f for f in out if _moved_up(f, cfg)]


def persistence_hits(kind: schema.FindingKind, cfg: config_mod.StragglerConfig) -> int:
    """How many of the last `window` steps a rank must be flagged in for its episode to be
    looked at: `strong_hits` for a straggler (reported there only with the stronger evidence,
    `StragglerConfig.strong_evidence`), else `min_hits`."""
    return min(cfg.min_hits, cfg.strong_hits) if kind is Kind.STRAGGLER else cfg.min_hits


def _reached(hits: npt.NDArray[np.int32], first: int, last: int, min_hits: int) -> int | None:
    """The first row of rows first..last (an episode) flagged in `min_hits` of the window's
    steps; None: none was."""
    reached = np.flatnonzero(hits[first : last + 1] >= min_hits)
    return first + int(reached[0]) if reached.size else None


def _held_until(hits: npt.NDArray[np.int32], last: int, min_hits: int) -> int:
    """The last row from `last` (an episode's last flagged row) on that its rank is still
    persistent: in at least `min_hits` of the window's steps."""
    after = np.flatnonzero(hits[last:] < min_hits)
    return max(last, last + int(after[0]) - 1 if after.size else hits.size - 1)


def _lasted(
    a: arrays_mod.StepArrays, began_s: float, at: int, last: int, seconds: float
) -> int | None:
    """A rank flagged more for its wait for a CPU than for its compute is reported once its
    episode (begun at `began_s`) has lasted `seconds` (`StragglerConfig.min_cpu_wait_episode_s`):
    the first row from `at` (persistent) to `last` by whose end it has; None: not yet."""
    with np.errstate(invalid="ignore"):  # a step with no time (NaN) is not reached
        reached = np.flatnonzero(a.step_end_s[at : last + 1] - began_s >= seconds)
    return at + int(reached[0]) if reached.size else None


def _moved_up(finding: schema.Finding, cfg: config_mod.StragglerConfig) -> bool:
    """Whether the finding's own headline evidence shows the metric up by the minimum excess
    (flags come from smoothed per-step scores; an episode whose median over its steps is not
    above the baseline is not reported: its evidence would contradict it), or its slow steps
    do (an intermittent one's median is what its usual steps look like: `shape.py`)."""
    if shape.said(finding.evidence) is shape.Kind.INTERMITTENT:
        return True
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
    extra: Sequence[schema.Evidence] = (),
    *,
    spread: shape.Shape | None = None,
    own: Own | None = None,
) -> schema.Finding:
    """A finding about one rank's episode over rows first..last (detected at row `at`), with
    `extra` evidence last; `spread`: its shape where already read (`_spread` of those rows);
    `own`: for a shift, its signal and the rank's own earlier level of it (`_own_signal`)."""
    rows = slice(first, last + 1)
    rank = int(a.ranks[col])
    flags = scores.flags(kind)[rows, col]
    z = float(np.nanmedian(scores.z(kind)[rows, col][flags])) if flags.any() else 0.0
    # A straggler flagged more for its wait for a CPU than for its compute: the host's cause.
    starved = kind is Kind.STRAGGLER and own is None and _starved(a, scores, rows, col)
    values, label = _signal(a, kind, starved=starved)
    # A step no rank timed (NaN) drops out, silently: the warning would reach the user's stderr.
    baseline = float(robust.nanmedian(robust.nanmedian(values[rows], 1), 0))
    note = f"median over steps; robust z {z:.1f}"
    if own is not None:
        values, label, baseline = own.values, own.label, own.baseline
        shifted = scores.forward[rows, col]
        strength = scores.forward_z[rows, col][shifted] if shifted.any() else np.zeros(1)
        shift = float(np.nanmedian(strength)) * cfg.min_shift / cfg.z_threshold
        note = (
            "median over steps, against its own earlier steps; its shift (less its peers') "
            f"{shift:.0%} of the step"
        )
    observed = float(np.nanmedian(values[rows, col]))
    ev = [
        findings.evidence(label, observed, baseline, unit="s", note=note),
        findings.evidence(
            "outlier_steps",
            int(flags.sum()),
            float(last - first + 1),
            note="flagged / steps in range",
        ),
    ]
    if spread is None:
        spread = _spread(a, kind, rows, col, starved=starved)
    against = shape.PEERS if own is None else shape.OWN
    ev.extend(shape.evidence(spread, against))
    if own is not None:
        ev.append(_peers_shift(rows, col, first, own, cfg))
    note = ""
    if kind is Kind.STRAGGLER:
        ev.extend(_arrival_evidence(a, rows, col))
        note = _throttle_note(a, rows, col, ev)
    ev.extend(extra)
    ratio = observed / baseline if baseline > 0 else float("inf")
    node = a.nodes[col]
    what = {Kind.STRAGGLER: "compute straggler", Kind.DATA_STALL: "data-loader stall"}[kind]
    if starved:
        what = "straggler waiting for a CPU (another process on its host takes its CPU time)"
    headline = f", {label} {ratio:.2f}x the median"
    if own is not None:
        headline = f", {label} {ratio:.2f}x its own earlier steps while its peers' did not grow"
    if spread.kind is shape.Kind.INTERMITTENT:  # the median is what its usual steps look like
        what, headline = f"intermittent {what}", ""
    summary = (
        f"rank {rank}{f' on {node}' if node else ''}: {what}{headline}"
        f"{shape.phrase(spread, label, against)}{note}"
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


def _spread(
    a: arrays_mod.StepArrays,
    kind: schema.FindingKind,
    rows: slice,
    col: int,
    *,
    starved: bool = False,
) -> shape.Shape:
    """How column `col`'s excess in its finding's signal spreads over `rows` (`shape.of`)."""
    values, _ = _signal(a, kind, starved=starved)
    peers = robust.others_median(values[rows], stage_groups(a.stages))[:, col]
    with np.errstate(all="ignore"):  # its value over its scoring group's others' median
        step = robust.nanmedian(a.step_time_s[rows], 1)
        return shape.of(values[rows, col] / peers, (values[rows, col] - peers) / step)


def _shifted(scores: Scores, rows: slice, col: int) -> bool:
    """Whether the episode was flagged more for a forward shift than for compute, and at
    least as much as for a wait for a CPU (its shift leaves that wait's growth out)."""
    shifts = int(scores.forward[rows, col].sum())
    return shifts > int(scores.compute[rows, col].sum()) and shifts >= int(
        scores.cpu[rows, col].sum()
    )


@dataclass(frozen=True)
class Own:
    """What a shift compares (`forward_shift.py`): `values` [steps, ranks], named `label` in
    its evidence, and the rank's own level of it before its episode (`baseline`)."""

    values: robust.FloatArray
    label: str
    baseline: float


# The shift's signals (in `forward_shift.SIGNALS` order): a forward pass's time, or a pipeline
# stage's own time outside its schedule (`StepArrays.pipeline_own_s`) or in its backward passes
# (`stage_backward_own_s`), with what the peers' evidence calls them.
_OWN_SIGNALS = {
    "forward_time": ("forward_s", "peers_forward_ratio", "forward time"),
    "outside_pipeline_time": (
        "pipeline_own_s",
        "peers_outside_pipeline_ratio",
        "own time outside the pipeline schedule",
    ),
    "stage_backward_time": (
        "stage_backward_own_s",
        "peers_stage_backward_ratio",
        "own time in the stage's backward passes",
    ),
}


# Each shift signal's evidence metric -> its StepArrays field.
OWN_FIELDS = {label: field for label, (field, _, _) in _OWN_SIGNALS.items()}


def _own_signal(
    a: arrays_mod.StepArrays,
    scores: Scores,
    first: int,
    last: int,
    col: int,
    cfg: config_mod.StragglerConfig,
) -> Own | None:
    """The signal that flagged most of column `col`'s shifted rows (its forward time, its
    time outside a pipeline schedule or in its backward passes) and its level before the
    episode; None where unknown."""
    rows = slice(first, last + 1)
    signals = scores.signal[rows, col][scores.forward[rows, col]]
    counts = np.bincount(signals, minlength=len(_OWN_SIGNALS))
    label = list(_OWN_SIGNALS)[int(np.argmax(counts))]  # ties: the first (forward time)
    values = getattr(a, _OWN_SIGNALS[label][0])
    if values is None:
        return None
    baseline = _earlier(values, first, col, cfg)
    return None if baseline is None else Own(values, label, baseline)


def _earlier(
    values: robust.FloatArray, first: int, col: int, cfg: config_mod.StragglerConfig
) -> float | None:
    """Column `col`'s level of `values` before its episode: the median of the 3 smoothing
    windows of steps before the one of its first flagged row (what its shift was measured
    against); None where none of them is known."""
    end = max(first - cfg.smooth_steps + 1, 0)
    before = values[max(end - 3 * cfg.smooth_steps, 0) : end, col]
    before = before[np.isfinite(before) & (before > 0)]
    return float(np.median(before)) if before.size else None


def _own_spread(a: arrays_mod.StepArrays, rows: slice, col: int, own: Own) -> shape.Shape:
    """A shift's shape: its signal over its own earlier level (`shape.of`)."""
    mine = own.values[rows, col].astype(np.float64)
    with np.errstate(all="ignore"):
        step = robust.nanmedian(a.step_time_s[rows], 1)
        return shape.of(mine / own.baseline, (mine - own.baseline) / step)


def _peers_shift(
    rows: slice, col: int, first: int, own: Own, cfg: config_mod.StragglerConfig
) -> schema.Evidence:
    """The other ranks' level of the shift's signal over the episode against theirs before
    it: the median of their ratios (a job-wide slowdown moves them alike)."""
    values = own.values
    ratios = [
        float(np.nanmedian(values[rows, c])) / before
        for c in range(values.shape[1])
        if c != col and (before := _earlier(values, first, c, cfg))
    ]
    finite = [r for r in ratios if np.isfinite(r)]
    _, metric, what = _OWN_SIGNALS[own.label]
    return findings.evidence(
        metric,
        float(np.median(finite)) if finite else float("nan"),
        1.0,
        note=f"the other ranks' {what} against their own earlier steps (median)",
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


def _reports_cpu_wait(cpu_wait: robust.FloatArray) -> bool:
    """Whether any rank reported a wait for a CPU (NaN compares false: no copy needed)."""
    return bool((cpu_wait > 0).any())


def _starved(a: arrays_mod.StepArrays, scores: Scores, rows: slice, col: int) -> bool:
    """Whether the episode was flagged more for a wait for a CPU than for its compute or its
    forward pass's shift."""
    cpu = int(scores.cpu[rows, col].sum())
    return cpu > int(scores.compute[rows, col].sum()) and cpu > int(scores.forward[rows, col].sum())


def _signal(
    a: arrays_mod.StepArrays, kind: schema.FindingKind, *, starved: bool = False
) -> tuple[robust.FloatArray, str]:
    if kind is Kind.STRAGGLER:
        if starved and a.cpu_wait_s is not None:
            return a.cpu_wait_s, "cpu_wait_time"
        return a.known_compute_s(), "compute_time"
    return a.data_s, "data_time"


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
    out = [
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
    cpu_wait = a.cpu_wait_s
    if cpu_wait is not None and _reports_cpu_wait(cpu_wait[rows]):
        with np.errstate(all="ignore"):
            mine = float(np.nanmedian(cpu_wait[rows, col]))
            peers = float(np.nanmedian(np.nanmedian(cpu_wait[rows], axis=1)))
        out.append(
            findings.evidence(
                "cpu_wait_time",
                mine,
                peers,
                unit="s",
                note="waiting for a CPU (the host's time), left out of compute_time",
            )
        )
    return out


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
