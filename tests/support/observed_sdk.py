"""One simulated rank's SDK: what the real SDK code records of what the rank did.

`observed.py` decides when each of a rank's ops was enqueued and completed (true seconds); a
`RankSdk` turns that into the rank's own observations: it sets a fake monotonic clock to the
rank's host clock (its own origin; wall time off by the host's offset), replays the ops into a
real `vigil.agent.collectives.CollectiveRecorder` (begin at enqueue, finish at completion, in
time order, so overlapped ops interleave as they would), and builds each step's records with
the flusher's own `vigil.agent.background.Background.settle`. It keeps what the progress page
would show (ops entered, steps ended, data spans) so that `heartbeat(t)` says what the flusher
would send at `t`.

The groups are stand-ins carrying the two attributes the recorder names a group by. Pairs of a
pipeline are named as the recorder names a labelled pp group's pair (`pp:<id>:p2p:<lo>-<hi>`):
its own peer naming calls `dist.get_rank()`, which needs a process group.

Test support only: no I/O, no real clocks, no process groups.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from vigil import schema
from vigil.agent import background, collectives, config, sinks
from vigil.agent import mfu as mfu_mod
from vigil.agent.phases import PhaseSums

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
PEAK_FLOPS = 1e15
FLOPS_PER_TOKEN = 6 * 7e9  # a 7B model
TOKENS = 4096  # per rank and step
T0 = 1.8e9  # true time of the job's start (a wall-clock instant)
_ONE_BYTE = torch.empty(1, dtype=torch.uint8)  # an op's bytes: this x `scale_bytes`
_KEY = 1_000_000  # op instance key: batch index x _KEY + member index


class Group:
    """Stands in for a ProcessGroup: the recorder names it from these two attributes."""

    def __init__(self, desc: str, name: str) -> None:
        self.group_desc, self.group_name = desc, name


@dataclass
class Op:
    """One op instance on a batch of ranks (true seconds; inf: never happened)."""

    ranks: I64
    begin: F64
    end: F64
    groups: list[Any]  # per member
    op: str
    nbytes: int
    blocking: bool
    overlapped: bool = False


@dataclass
class StepTimes:
    """A step's phase boundaries per rank (true seconds)."""

    start: F64
    data_end: F64
    end: F64
    forward_s: F64  # inside the model's forward passes (a stage's: its sends and receives not)
    backward_s: F64
    optimizer_s: F64
    # The pipeline schedule's start and end (pp > 1; None: no schedule): the SDK times its
    # `step` and reads the recorder's blocked time at both ends.
    pipeline_start: F64 | None = None
    pipeline_end: F64 | None = None
    # The stage's backward passes (pp > 1): their seconds, and of them its waits in
    # collectives there (the SDK's `stage_backward_s`, `stage_backward_wait_s`).
    stage_backward: tuple[F64, F64] | None = None


Event = tuple[float, int, int, Op]  # (true time, 1 begin / 0 finish, key, op)


def events_by_rank(ops: list[Op], num_ranks: int) -> list[list[Event]]:
    """Each rank's begins and finishes of `ops`."""
    out: list[list[Event]] = [[] for _ in range(num_ranks)]
    for k, op in enumerate(ops):
        ranks, begins, ends = op.ranks.tolist(), op.begin.tolist(), op.end.tolist()
        for j, (r, b, e) in enumerate(zip(ranks, begins, ends, strict=True)):
            out[r].append((b, 1, k * _KEY + j, op))
            out[r].append((e, 0, k * _KEY + j, op))
    return out


@dataclass
class _Page:
    """What the rank's progress page showed over time."""

    op_begin: list[float] = field(default_factory=list)
    op_end: list[float] = field(default_factory=list)
    op_where: list[tuple[str, int, str, bool]] = field(default_factory=list)
    step_end: list[float] = field(default_factory=list)
    data_spans: list[tuple[float, float]] = field(default_factory=list)


class RankSdk:
    def __init__(
        self, *, job_id: str, rank: int, world_size: int, mono_origin: float, wall_offset: float
    ) -> None:
        self.job_id, self.rank = job_id, rank
        self.mono_origin, self.wall_offset = mono_origin, wall_offset
        self.page = _Page()
        self._now = [0.0]
        wall_minus_mono = T0 + wall_offset - mono_origin

        def clock() -> float:
            return self._now[0]

        self.recorder = collectives.CollectiveRecorder(
            page=None, on_error=_raise, clock=clock, wall_offset_s=wall_minus_mono
        )
        self._queue = sinks.RecordQueue(1 << 20)
        self._ended: collections.deque[background.EndedStep] = collections.deque()
        self._flusher = background.Background(
            cfg=config.SdkConfig(
                job=job_id, rank=rank, world_size=world_size,
                progress_dir=Path("/nonexistent"), measure_cpu_peak=False,
            ),
            queue=self._queue, recorder=self.recorder, page_path=Path("/nonexistent"),
            ended=self._ended, clock=clock, wall_offset_s=wall_minus_mono,
            flops_per_token=lambda: FLOPS_PER_TOKEN, cuda_device=lambda: None,
            write_health=lambda: None, dump_evidence=lambda _reason: None,
        )  # fmt: skip
        self._flusher.peak_memory_bytes = 40 << 30  # the device's, as the flusher reads it

    def _mono(self, true_s: float) -> float:
        return true_s - T0 + self.mono_origin

    def record_step(self, step: int, events: list[Event], times: StepTimes) -> list[schema.Record]:
        """Replay one step's ops; the step's records (none if the rank never ended it)."""
        rec, page, r = self.recorder, self.page, self.rank
        rec.step = step
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        pending: dict[int, tuple[Any, int]] = {}
        # The schedule's ends: the recorder's blocked time read there (ops end at a finish).
        ends = [] if times.pipeline_start is None or times.pipeline_end is None else [
            float(times.pipeline_start[r]), float(times.pipeline_end[r])
        ]  # fmt: skip
        blocked_at: list[float] = []
        for t, is_begin, key, op in events:
            if not np.isfinite(t):
                break  # sorted: the rest never happened either
            while len(blocked_at) < len(ends) and _passed(len(blocked_at), ends, t):
                blocked_at.append(rec.blocked_s)
            self._now[0] = self._mono(t)
            j = key % _KEY
            if is_begin:
                p = rec.begin(op.op, op.groups[j], _ONE_BYTE, None, blocking=op.blocking,
                              scale_bytes=op.nbytes, overlapped=op.overlapped)  # fmt: skip
                pending[key] = (p, len(page.op_begin))
                page.op_begin.append(t)
                page.op_end.append(np.inf)
                page.op_where.append((p.site.group, p.seq, op.op, op.blocking))
            elif key in pending:
                p, index = pending.pop(key)
                rec.finish(p, sync=op.blocking)
                page.op_end[index] = t
        start, end = float(times.start[r]), float(times.end[r])
        page.data_spans.append((start, float(times.data_end[r])))
        if not np.isfinite(end):
            return []  # the step never ended: no record (its ops stay in the recorder)
        blocked_at += [rec.blocked_s] * (len(ends) - len(blocked_at))
        pipeline = (0.0, 0.0) if not ends else (ends[1] - ends[0], blocked_at[1] - blocked_at[0])
        stage_backward = times.stage_backward
        backward = (0.0, 0.0) if stage_backward is None else (
            float(stage_backward[0][r]), float(stage_backward[1][r])
        )  # fmt: skip
        self._now[0] = self._mono(end)
        aggs, blocked, _total = rec.swap()
        util = mfu_mod.mfu(flops_per_token=FLOPS_PER_TOKEN, tokens=TOKENS, seconds=end - start,
                           peak_flops=PEAK_FLOPS)  # fmt: skip
        data = {"data": float(times.data_end[r]) - start}
        self._ended.append(
            background.EndedStep(
                step, self._mono(start), self._mono(end), TOKENS, 2.0,
                PhaseSums(float(times.forward_s[r]), float(times.backward_s[r]),
                          float(times.optimizer_s[r]), 0.0, pipeline[0], 0.0, pipeline[1],
                          *backward),
                blocked, aggs, data, util,
            )
        )  # fmt: skip
        self._flusher.settle()
        page.step_end.append(end)
        return self._queue.drain()

    def heartbeat(self, true_s: float) -> schema.Heartbeat:
        """What the rank's flusher would send at `true_s`, read off its progress page."""
        page = self.page
        last_step = int(np.searchsorted(page.step_end, true_s, side="right")) - 1
        k = int(np.searchsorted(page.op_begin, true_s, side="right")) - 1
        group, seq, op, state = "", 0, "", schema.RankState.COMPUTE
        if k >= 0:
            group, seq, op, blocking = page.op_where[k]
            if blocking and page.op_end[k] > true_s:
                state = schema.RankState.IN_COLLECTIVE
        if last_step + 1 < len(page.data_spans):
            s0, s1 = page.data_spans[last_step + 1]
            if s0 <= true_s < s1:
                state = schema.RankState.DATA
        return schema.Heartbeat(
            job_id=self.job_id, rank=self.rank, time_s=true_s + self.wall_offset,
            last_step=last_step, last_group=group, last_seq=seq, last_op=op, state=state,
        )  # fmt: skip


def _passed(i: int, ends: list[float], t: float) -> bool:
    """Whether an event at `t` comes after the schedule's end `i` (0: its start, read before
    that instant's events; 1: its end, read after them)."""
    return t >= ends[0] if i == 0 else t > ends[1]


def _raise(exc: BaseException) -> None:
    raise exc
