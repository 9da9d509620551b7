"""Analyses of imported Kineto traces: per-rank temporal breakdown, communication-computation
overlap, kernel breakdown, NCCL collectives, clock alignment and lagging ranks across files.

Definitions follow HolisticTraceAnalysis so the figures can be compared with it: the span is
first kernel start to last kernel end on the GPU (all streams), idle = span minus the union of
all kernel intervals, compute = union of computation kernels, non-compute = the rest; overlap =
time computation and communication kernels run at once / time communication kernels run.
Clock alignment uses the fact that a collective ends at nearly the same instant on every member:
each rank's offset is the median difference of its collective end times from the reference
rank's. Pure numpy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vigil.analyzer import kineto

F64 = npt.NDArray[np.float64]


def merge_intervals(ts: F64, end: F64) -> tuple[F64, F64]:
    """Union of intervals as sorted disjoint (start, end) arrays (touching intervals merge)."""
    if ts.size == 0:
        return ts, end
    order = np.argsort(ts, kind="stable")
    ts, end = ts[order], end[order]
    running_end = np.maximum.accumulate(end)
    new_group = np.empty(ts.size, dtype=bool)
    new_group[0] = True
    new_group[1:] = ts[1:] > running_end[:-1]
    group = np.cumsum(new_group) - 1
    starts = ts[new_group]
    ends = np.full(starts.size, -np.inf)
    np.maximum.at(ends, group, end)
    return starts, ends


def intersection_length(a: tuple[F64, F64], b: tuple[F64, F64]) -> float:
    """Total length of the intersection of two unions of disjoint sorted intervals."""
    (a0, a1), (b0, b1) = a, b
    if a0.size == 0 or b0.size == 0:
        return 0.0
    # Sweep: +1 at starts, -1 at ends of each set; time where both counts are 1 overlaps.
    times = np.concatenate([a0, a1, b0, b1])
    delta_a = np.concatenate([np.ones(a0.size), -np.ones(a1.size), np.zeros(b0.size + b1.size)])
    delta_b = np.concatenate([np.zeros(a0.size + a1.size), np.ones(b0.size), -np.ones(b1.size)])
    order = np.argsort(times, kind="stable")
    times = times[order]
    in_a = np.cumsum(delta_a[order])
    in_b = np.cumsum(delta_b[order])
    both = (in_a > 0) & (in_b > 0)
    return float(np.sum(np.diff(times)[both[:-1]]))


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """One rank's GPU time: idle / compute / non-compute, microseconds and percent of the span."""

    rank: int
    idle_us: float
    compute_us: float
    non_compute_us: float
    span_us: float

    def pct(self, part: float) -> float:
        return 100.0 * part / self.span_us if self.span_us > 0 else 0.0

    @property
    def idle_pct(self) -> float:
        return self.pct(self.idle_us)

    @property
    def compute_pct(self) -> float:
        return self.pct(self.compute_us)

    @property
    def non_compute_pct(self) -> float:
        return self.pct(self.non_compute_us)


def temporal_breakdown(trace: kineto.KinetoTrace) -> Breakdown:
    starts, ends = merge_intervals(trace.ts, trace.end)
    if starts.size == 0:
        return Breakdown(
            rank=trace.rank, idle_us=0.0, compute_us=0.0, non_compute_us=0.0, span_us=0.0
        )
    span = float(ends[-1] - starts[0])
    busy = float(np.sum(ends - starts))
    comp = trace.ktype == kineto.COMPUTATION
    cs, ce = merge_intervals(trace.ts[comp], trace.end[comp])
    compute = float(np.sum(ce - cs))
    idle = span - busy
    return Breakdown(
        rank=trace.rank,
        idle_us=idle,
        compute_us=compute,
        non_compute_us=span - compute - idle,
        span_us=span,
    )


def comm_comp_overlap_pct(trace: kineto.KinetoTrace) -> float:
    """Percent of communication kernel time that overlaps computation kernels."""
    comm = trace.ktype == kineto.COMMUNICATION
    comp = trace.ktype == kineto.COMPUTATION
    comm_u = merge_intervals(trace.ts[comm], trace.end[comm])
    comm_time = float(np.sum(comm_u[1] - comm_u[0]))
    if comm_time <= 0:
        return 0.0
    return (
        100.0
        * intersection_length(comm_u, merge_intervals(trace.ts[comp], trace.end[comp]))
        / comm_time
    )


@dataclass(frozen=True, kw_only=True)
class KernelStat:
    name: str
    kind: str
    count: int
    total_us: float
    share_pct: float  # of all kernel time on the rank


def kernel_breakdown(trace: kineto.KinetoTrace, *, top: int = 10) -> list[KernelStat]:
    """The kernels that took the most GPU time, with their class."""
    dur = trace.end - trace.ts
    totals = np.bincount(trace.name_id, weights=dur, minlength=len(trace.names))
    counts = np.bincount(trace.name_id, minlength=len(trace.names))
    all_time = float(totals.sum()) or 1.0
    order = np.argsort(-totals)[:top]
    types = np.zeros(len(trace.names), dtype=np.int8)
    types[trace.name_id] = trace.ktype
    return [
        KernelStat(
            name=trace.names[i],
            kind=kineto.KERNEL_TYPE_NAMES[int(types[i])],
            count=int(counts[i]),
            total_us=float(totals[i]),
            share_pct=100.0 * float(totals[i]) / all_time,
        )
        for i in order
    ]


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One NCCL collective kernel on one rank."""

    rank: int
    index: int  # occurrence number of (group, op) on this rank
    meta: kineto.NcclMeta
    ts: float
    end: float


def is_point_to_point(op: str) -> bool:
    """Send/recv pairs do not end together across a group, so they cannot align clocks."""
    lowered = op.lower()
    return "send" in lowered or "recv" in lowered


def collectives(trace: kineto.KinetoTrace) -> list[Collective]:
    """The trace's collectives (point-to-point kernels excluded), numbered per (group, op)."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    out = []
    for i in sorted(trace.nccl):
        meta = trace.nccl[i]
        if is_point_to_point(meta.op):
            continue
        key = (meta.group, meta.op)
        out.append(
            Collective(
                rank=trace.rank,
                index=seen[key],
                meta=meta,
                ts=float(trace.ts[i]),
                end=float(trace.end[i]),
            )
        )
        seen[key] += 1
    return out


@dataclass(frozen=True, kw_only=True)
class CollectiveStat:
    """NCCL kernels of one kind on one rank: how many, how many bytes, how long on the GPU."""

    group: str
    op: str
    dtype: str
    algorithm: str
    protocol: str
    count: int
    total_bytes: int  # -1 when the trace has no message sizes (older profilers)
    total_us: float


def collective_stats(trace: kineto.KinetoTrace) -> list[CollectiveStat]:
    """NCCL kernels grouped by (group, op, dtype, algorithm, protocol), longest total first."""
    acc: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for i, meta in trace.nccl.items():
        row = acc[(meta.group, meta.op, meta.dtype, meta.algorithm, meta.protocol)]
        row[0] += 1
        row[1] = -1 if meta.bytes < 0 or row[1] < 0 else row[1] + meta.bytes
        row[2] += float(trace.end[i] - trace.ts[i])
    stats = [
        CollectiveStat(
            group=k[0],
            op=k[1],
            dtype=k[2],
            algorithm=k[3],
            protocol=k[4],
            count=int(v[0]),
            total_bytes=int(v[1]),
            total_us=v[2],
        )
        for k, v in acc.items()
    ]
    return sorted(stats, key=lambda c: -c.total_us)


@dataclass(frozen=True, kw_only=True)
class Alignment:
    """Per-rank clock offsets (us, to subtract) and the residual skew after aligning."""

    reference_rank: int
    offsets_us: dict[int, float]
    residual_us: dict[int, float]  # median |end difference| left after alignment
    matched: int  # collectives matched across ranks


@dataclass(frozen=True, kw_only=True)
class Lag:
    """How late each rank arrives at matched collectives (after alignment)."""

    rank: int
    last_share: float  # share of matched collectives this rank started last
    median_lateness_us: float  # median start delay vs the earliest member


def _matched(
    per_rank: dict[int, list[Collective]],
) -> dict[tuple[str, str, int], dict[int, Collective]]:
    table: dict[tuple[str, str, int], dict[int, Collective]] = defaultdict(dict)
    for rank, items in per_rank.items():
        for c in items:
            table[(c.meta.group, c.meta.op, c.index)][rank] = c
    return {k: v for k, v in table.items() if len(v) == len(per_rank)}


def align_clocks(traces: Sequence[kineto.KinetoTrace]) -> Alignment | None:
    """Offsets that make matched collectives end together; None with < 2 ranks or no matches."""
    per_rank = {t.rank: collectives(t) for t in traces if t.nccl}
    if len(per_rank) < 2:
        return None
    matched = _matched(per_rank)
    if not matched:
        return None
    ref = min(per_rank)
    offsets, residual = {}, {}
    for rank in per_rank:
        diffs = np.array([m[rank].end - m[ref].end for m in matched.values()])
        offsets[rank] = float(np.median(diffs))
        residual[rank] = float(np.median(np.abs(diffs - offsets[rank])))
    return Alignment(
        reference_rank=ref, offsets_us=offsets, residual_us=residual, matched=len(matched)
    )


def lagging_ranks(
    traces: Sequence[kineto.KinetoTrace], alignment: Alignment | None = None
) -> list[Lag]:
    """Per rank: how often it starts matched collectives last, after clock alignment."""
    alignment = alignment or align_clocks(traces)
    if alignment is None:
        return []
    per_rank = {t.rank: collectives(t) for t in traces if t.nccl}
    matched = _matched(per_rank)
    ranks = sorted(per_rank)
    starts = np.array(
        [[m[r].ts - alignment.offsets_us[r] for r in ranks] for m in matched.values()]
    )
    late = starts - starts.min(axis=1, keepdims=True)
    last = np.argmax(starts, axis=1)
    return [
        Lag(
            rank=r,
            last_share=float(np.mean(last == j)),
            median_lateness_us=float(np.median(late[:, j])),
        )
        for j, r in enumerate(ranks)
    ]
