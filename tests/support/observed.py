"""A simulated job as its ranks would observe it, recorded through the SDK's own code.

Unlike `simulator.py` (which writes the analyzer's measurement model straight into arrays), this
module models what happens and lets the SDK measure it:

- each rank computes (a per-rank speed, a per-step job-wide swing, per rank-step jitter and
  per-layer wobble around it, one-off hiccups, bursts of CPU load; faults add time in one
  position: before forward, in forward, in backward, in the optimizer step, or in data loading
  inside `span("data")`);
- collectives are synchronous: an op completes on every member at the last member's arrival
  plus its transfer time (jittered per op, slower through a faulty NIC) plus a small per-member
  completion skew; DDP's gradient buckets run behind backward and are waited for at its end,
  tensor-parallel all-reduces and the data-parallel all-reduce block, a pipeline (GPipe order,
  `microbatches` per step) sends and receives between stages, inside a schedule that the SDK
  times as it times a pipelining schedule's `step` (the stages' forward and backward passes
  and their gradients' data-parallel all-reduce; the forward hooks hold no send or receive);
- every rank has its host's clocks: a monotonic clock with its own origin and a wall clock off
  true time by the host's offset; heartbeats go out once per flush interval, some are lost.

Each rank's ops (enqueue and completion) go to its `observed_sdk.RankSdk`, which replays them on
the rank's own host clock into a real `vigil.agent.collectives.CollectiveRecorder` and builds
each step's records with the SDK's own `vigil.agent.background.Background.settle`; heartbeats
carry what the rank's progress page would say at their instant (last step, last collective
entered, state). So the analyzer sees what it would see from real ranks, not the quantities
it assumes.

A hang stops its rank at a position in one step: the rank's time becomes infinite there, and so
does every op that waits for it, transitively (no other rule decides who is stuck).

Test support only (it imports the SDK, which imports torch): no I/O, no real clocks, seeded.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.support import observed_sdk as sdk
from vigil import schema

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class Position(enum.StrEnum):
    BEFORE = "before"  # before the forward pass (a sleep, a host-side stall)
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    DATA = "data"  # inside span("data")


class FaultKind(enum.StrEnum):
    STRAGGLER = "straggler"  # `factor` x the rank's compute time, added at `position`
    HANG = "hang"  # the rank stops at `position` of `start_step`
    SLOW_LINK = "slow_link"  # the rank's NIC: its inter-node groups move bytes `factor` x slower


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: FaultKind
    rank: int
    start_step: int
    factor: float = 2.0
    position: Position = Position.BEFORE
    every: int = 1  # intermittent: only every `every`-th step from `start_step`
    ramp: float = 0.0  # > 0: the extra grows by `ramp` x compute each step (factor ignored)

    def __post_init__(self) -> None:
        if self.factor < 1.0 or self.every < 1 or self.ramp < 0 or self.start_step < 0:
            raise ValueError("fault factor must be >= 1, every >= 1, ramp and start_step >= 0")

    def extra(self, step: int, compute_s: float) -> float:
        """Extra seconds of a straggler at `step` (0 before it starts and between its steps)."""
        k = step - self.start_step
        if k < 0 or k % self.every:
            return 0.0
        if self.ramp > 0:
            return compute_s * self.ramp * (k + 1)
        return compute_s * (self.factor - 1.0)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A simulated job: layout, step mix, timings, noise and faults."""

    job_id: str = "obs"
    tp: int = 1
    dp: int = 8
    pp: int = 1
    ranks_per_node: int = 8
    ddp: bool = True  # the dp gradient all-reduce in buckets behind backward (pp = tp = 1)
    layers: int = 4  # tp all-reduces per forward and per backward
    buckets: int = 4
    microbatches: int = 4
    num_steps: int = 40
    compute_s: float = 0.6  # forward + backward + optimizer at nominal speed
    data_s: float = 0.02
    tp_transfer_s: float = 0.004
    dp_transfer_s: float = 0.08  # all buckets together
    p2p_transfer_s: float = 0.01
    transfer_jitter: float = 0.05  # lognormal sigma per op
    completion_skew_s: float = 2e-4  # mean per-member lag behind the op's common end
    rank_spread: float = 0.01
    step_swing: float = 0.03
    jitter: float = 0.05  # per rank-step: uniform in +-jitter
    layer_jitter: float = 0.03  # per rank and layer (or bucket) chunk, around the step's pace
    hiccup_rate: float = 0.002  # per rank-step: 1.5-3x that step's compute
    load_bursts: int = 0  # job-wide CPU load: bursts of 3-6 steps, every rank up to 1.4x
    clock_offset_s: float = 0.005  # sigma of hosts' wall-clock offsets
    heartbeat_interval_s: float = 1.0
    heartbeat_loss: float = 0.05
    faults: tuple[Fault, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.pp, self.ranks_per_node, self.layers) < 1:
            raise ValueError("tp, dp, pp, ranks_per_node and layers must be >= 1")
        if self.ddp and (self.tp > 1 or self.pp > 1):
            raise ValueError("ddp buckets need tp = pp = 1 (use ddp=False for a 3-D layout)")
        if min(self.buckets, self.microbatches, self.num_steps) < 1:
            raise ValueError("buckets, microbatches and num_steps must be >= 1")
        if len([f for f in self.faults if f.kind is FaultKind.HANG]) > 1:
            raise ValueError("at most one hang per job")
        for f in self.faults:
            if not 0 <= f.rank < self.num_ranks:
                raise ValueError(f"fault rank {f.rank} outside 0..{self.num_ranks - 1}")

    @property
    def num_ranks(self) -> int:
        return self.tp * self.dp * self.pp

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True, kw_only=True)
class HangTruth:
    rank: int
    step: int
    onset_s: float  # true time the rank stopped


class _Layout:
    """Ranks (Megatron order: tp fastest, pp slowest), their groups and p2p pairs."""

    def __init__(self, cfg: JobConfig) -> None:
        tp, dp, pp = cfg.tp, cfg.dp, cfg.pp
        grid = np.arange(cfg.num_ranks, dtype=np.int64).reshape(pp, dp, tp)
        self.stage = [grid[s].reshape(-1) for s in range(pp)]
        self.tp_groups = grid.reshape(pp * dp, tp) if tp > 1 else None
        self.dp_groups = grid.transpose(0, 2, 1).reshape(pp * tp, dp) if dp > 1 else None
        world = tp == pp == 1
        self.tp_objs = [sdk.Group("tp", str(i)) for i in range(pp * dp)]
        self.dp_objs = [None if world else sdk.Group("dp", str(100 + i)) for i in range(pp * tp)]
        self.pairs: dict[tuple[int, int], sdk.Group] = {}
        for s in range(pp - 1):
            for lo, hi in zip(self.stage[s].tolist(), self.stage[s + 1].tolist(), strict=True):
                # As the recorder names a pair of a labelled pp group (`pp:<id>:p2p:<lo>-<hi>`):
                # its peer naming calls dist.get_rank(), which needs a process group.
                self.pairs[(lo, hi)] = sdk.Group("pp", f"{200 + s}:p2p:{lo}-{hi}")
        self.nodes = np.arange(cfg.num_ranks) // cfg.ranks_per_node


class Job:
    """Runs a `JobConfig` step by step; `records()` and `heartbeats()` give what it shipped."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        n = cfg.num_ranks
        self.rng = np.random.default_rng(cfg.seed)
        self.layout = _Layout(cfg)
        num_nodes = int(self.layout.nodes.max()) + 1
        self.wall_offset = self.rng.normal(0.0, cfg.clock_offset_s, num_nodes)
        self.mono_origin = self.rng.uniform(1e3, 1e6, num_nodes)
        self.speed = self.rng.lognormal(0.0, cfg.rank_spread, n)
        self.t = np.full(n, sdk.T0)  # true time, per rank
        self.records: list[schema.Record] = []  # identity (Job, RankInfo)
        # (true time it reached the collector, records): each rank's step records and
        # aggregates, shipped at its flusher's next tick after the step's end.
        self.shipped: list[tuple[float, list[schema.Record]]] = []
        self._ship_lag = self.rng.uniform(0.0, cfg.heartbeat_interval_s, n)
        self.hang: HangTruth | None = None
        self.slow_nic = {f.rank: f for f in cfg.faults if f.kind is FaultKind.SLOW_LINK}
        self._loaded = self._load_steps()
        self.ranks = [
            sdk.RankSdk(
                job_id=cfg.job_id, rank=r, world_size=n, mono_origin=self._host(r)[0],
                wall_offset=self._host(r)[1],
            )
            for r in range(n)
        ]  # fmt: skip
        self.records.extend(self._identity())
        self.steps_done = 0
        self._p2p_s = np.zeros(n)  # per rank: seconds in sends and receives this pass
        self._blocked_s = np.zeros(n)  # ... and in blocking collectives

    # -- set-up -----------------------------------------------------------------------------
    def _load_steps(self) -> set[int]:
        steps: set[int] = set()
        for _ in range(self.cfg.load_bursts):
            start = int(self.rng.integers(0, self.cfg.num_steps))
            steps.update(range(start, start + int(self.rng.integers(3, 7))))
        return steps

    def _host(self, rank: int) -> tuple[float, float]:
        node = int(self.layout.nodes[rank])
        return float(self.mono_origin[node]), float(self.wall_offset[node])

    def _identity(self) -> list[schema.Record]:
        cfg = self.cfg
        layout = schema.ParallelLayout(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
        out: list[schema.Record] = [
            schema.Job(
                job_id=cfg.job_id,
                world_size=cfg.num_ranks,
                layout=layout,
                peak_flops=sdk.PEAK_FLOPS,
            )
        ]
        out.extend(
            schema.RankInfo(
                job_id=cfg.job_id, rank=r, node=self.node_name(r),
                local_rank=r % cfg.ranks_per_node, device_uuid=f"GPU-{r:08d}",
            )
            for r in range(cfg.num_ranks)
        )  # fmt: skip
        return out

    def node_name(self, rank: int) -> str:
        return f"node{int(self.layout.nodes[rank]):04d}"

    # -- the model --------------------------------------------------------------------------
    def _compute(self, step: int) -> F64:
        cfg, rng, n = self.cfg, self.rng, self.cfg.num_ranks
        swing = rng.lognormal(0.0, cfg.step_swing)
        c = cfg.compute_s * swing * self.speed * (1.0 + rng.uniform(-cfg.jitter, cfg.jitter, n))
        hiccup = rng.random(n) < cfg.hiccup_rate
        c[hiccup] *= rng.uniform(1.5, 3.0, int(hiccup.sum()))
        if step in self._loaded:
            c *= rng.uniform(1.0, 1.4, n)
        return c

    def _transfer(self, base_s: float, groups: I64) -> F64:
        """Per group (rows of member ranks): one op's transfer time."""
        t = base_s * self.rng.lognormal(0.0, self.cfg.transfer_jitter, (groups.shape[0],))
        for rank, fault in self.slow_nic.items():
            crosses = (self.layout.nodes[groups] != self.layout.nodes[groups[:, :1]]).any(axis=1)
            hit = (groups == rank).any(axis=1) & crosses
            t[hit] *= fault.factor if self.steps_done >= fault.start_step else 1.0
        return t

    def _wobble(self, n: int) -> F64:
        j = self.cfg.layer_jitter
        return 1.0 + self.rng.uniform(-j, j, n)

    def _skew(self, shape: tuple[int, ...]) -> F64:
        return self.rng.exponential(self.cfg.completion_skew_s, shape)

    def _collective(
        self, ops: list[sdk.Op], members: I64, objs: list[Any], op: str, nbytes: int, base_s: float
    ) -> None:
        """A blocking collective over each row of `members`."""
        arrive = self.t[members]
        end = arrive.max(axis=1, keepdims=True) + self._transfer(base_s, members)[:, None]
        end = end + self._skew(members.shape)
        groups = [objs[g] for g in range(members.shape[0]) for _ in range(members.shape[1])]
        ops.append(sdk.Op(members.reshape(-1), arrive.reshape(-1), end.reshape(-1), groups, op,
                       nbytes, blocking=True))  # fmt: skip
        self._blocked_s[members] += end - arrive
        self.t[members] = end

    def _p2p(self, ops: list[sdk.Op], src: I64, dst: I64, sent: F64, nbytes: int) -> None:
        """Blocking send (issued at `sent`) from each `src` to its `dst`, which receives now."""
        recv_at = self.t[dst]
        pairs = np.stack([src, dst], axis=1)
        done = np.maximum(sent, recv_at) + self._transfer(self.cfg.p2p_transfer_s, pairs)
        objs = [self.layout.pairs[(min(a, b), max(a, b))] for a, b in pairs.tolist()]
        end_src, end_dst = done + self._skew(done.shape), done + self._skew(done.shape)
        ops.append(sdk.Op(src, sent, end_src, objs, "send", nbytes, blocking=True))
        ops.append(sdk.Op(dst, recv_at, end_dst, objs, "recv", nbytes, blocking=True))
        self._p2p_s[src] += end_src - sent
        self._p2p_s[dst] += end_dst - recv_at
        self.t[src], self.t[dst] = end_src, end_dst

    def _stop(self, rank: int, step: int) -> None:
        if self.hang is None and np.isfinite(self.t[rank]):
            self.hang = HangTruth(rank=rank, step=step, onset_s=float(self.t[rank]))
        self.t[rank] = np.inf

    def step(self) -> None:
        """Simulate one step on every rank and record it through the SDK."""
        with np.errstate(invalid="ignore"):  # inf - inf where a hung rank's phases would be
            self._step()

    def _step(self) -> None:
        cfg, lay, i = self.cfg, self.layout, self.steps_done
        n = cfg.num_ranks
        compute = self._compute(i)
        extra = {p: np.zeros(n) for p in Position}
        hang = next((f for f in cfg.faults if f.kind is FaultKind.HANG and f.start_step == i), None)
        stop_at = hang.position if hang is not None else None
        for f in cfg.faults:
            if f.kind is FaultKind.STRAGGLER:
                extra[f.position][f.rank] += f.extra(i, cfg.compute_s * float(self.speed[f.rank]))
        ops: list[sdk.Op] = []
        start = self.t.copy()
        if hang is not None and stop_at is Position.DATA:
            self._stop(hang.rank, i)
        self.t = self.t + cfg.data_s * self.rng.lognormal(0.0, 0.1, n) + extra[Position.DATA]
        data_end = self.t.copy()
        if hang is not None and stop_at in (Position.BEFORE, Position.FORWARD):
            self._stop(hang.rank, i)
        self.t += extra[Position.BEFORE]
        chunks = cfg.layers * cfg.microbatches
        fwd_start = self.t.copy()
        self._p2p_s = np.zeros(n)
        self._passes(ops, (compute / 3 + extra[Position.FORWARD]) / chunks, forward=True)
        fwd_end = self.t.copy()
        fwd_p2p = self._p2p_s.copy()  # outside the stage's forward hooks
        bwd_total = compute * 0.6 + extra[Position.BACKWARD]
        stage_bwd: tuple[F64, F64] | None = None
        if hang is not None and stop_at is Position.BACKWARD:  # halfway through its backward
            self.t[hang.rank] += bwd_total[hang.rank] / 2
            self._stop(hang.rank, i)
        if cfg.ddp:
            self._ddp_backward(ops, bwd_total)
        else:
            self._p2p_s, self._blocked_s = np.zeros(n), np.zeros(n)
            self._passes(ops, bwd_total / chunks, forward=False)
            # The stage's backward passes, as the SDK times them: not their sends and
            # receives (the schedule's), their tensor-parallel all-reduces as waits in them.
            stage_bwd = (self.t - fwd_end - self._p2p_s, self._blocked_s.copy())
            if lay.dp_groups is not None:
                self._collective(ops, lay.dp_groups, lay.dp_objs, "all_reduce", 1 << 26,
                                 cfg.dp_transfer_s)  # fmt: skip
        bwd_end = self.t.copy()
        if hang is not None and stop_at is Position.OPTIMIZER:
            self._stop(hang.rank, i)
        self.t += compute * (1 - 1 / 3 - 0.6) + extra[Position.OPTIMIZER]
        # A pipeline's schedule runs its stages' forward and backward passes, and their
        # gradients' data-parallel all-reduce (as Megatron's and torch's schedules do).
        piped = cfg.pp > 1
        times = sdk.StepTimes(
            start=start, data_end=data_end, end=self.t.copy(),
            forward_s=fwd_end - fwd_start - fwd_p2p, backward_s=bwd_end - fwd_end,
            optimizer_s=self.t - bwd_end, pipeline_start=fwd_start if piped else None,
            pipeline_end=bwd_end if piped else None,
            stage_backward=stage_bwd if piped else None,
        )  # fmt: skip
        self._record(i, ops, times)
        self.steps_done += 1

    def _passes(self, ops: list[sdk.Op], chunk: F64, *, forward: bool) -> None:
        """Forward (or backward) over every micro-batch and stage, layer by layer."""
        cfg, lay = self.cfg, self.layout
        stages = range(cfg.pp) if forward else range(cfg.pp - 1, -1, -1)
        step_dir = 1 if forward else -1
        sent: dict[int, F64] = {}
        for _m in range(cfg.microbatches):
            for s in stages:
                here = lay.stage[s]
                prev = s - step_dir
                if 0 <= prev < cfg.pp and prev in sent:
                    self._p2p(ops, lay.stage[prev], here, sent.pop(prev), 1 << 22)
                for _layer in range(cfg.layers):
                    self.t[here] += chunk[here] * self._wobble(here.size)
                    if lay.tp_groups is not None:
                        rows = lay.tp_groups[s * cfg.dp : (s + 1) * cfg.dp]
                        objs = lay.tp_objs[s * cfg.dp : (s + 1) * cfg.dp]
                        self._collective(ops, rows, objs, "all_reduce", 1 << 20, cfg.tp_transfer_s)
                if 0 <= s + step_dir < cfg.pp:
                    sent[s] = self.t[here].copy()  # blocked in its send until the peer receives

    def _ddp_backward(self, ops: list[sdk.Op], bwd: F64) -> None:
        """`bwd`: each rank's whole backward compute."""
        # Backward in `buckets` chunks, each launching an all-reduce that overlaps the rest;
        # backward ends when its own compute and the last bucket are done.
        cfg, lay = self.cfg, self.layout
        members = lay.dp_groups
        chunk = bwd / cfg.buckets
        prev_end = np.full(1 if members is None else members.shape[0], -np.inf)
        last_end = None
        for _b in range(cfg.buckets):
            self.t += chunk * self._wobble(cfg.num_ranks)
            if members is None:
                continue
            arrive = self.t[members]
            begin = np.maximum(arrive.max(axis=1), prev_end)
            done = begin + self._transfer(cfg.dp_transfer_s / cfg.buckets, members)
            prev_end = done
            end = done[:, None] + self._skew(members.shape)
            groups = [
                lay.dp_objs[g] for g in range(members.shape[0]) for _ in range(members.shape[1])
            ]
            ops.append(sdk.Op(members.reshape(-1), arrive.reshape(-1), end.reshape(-1), groups,
                           "ddp_all_reduce", 1 << 24, blocking=False, overlapped=True))  # fmt: skip
            last_end = end
        if members is not None and last_end is not None:
            self.t[members] = np.maximum(self.t[members], last_end)

    # -- through the SDK ----------------------------------------------------------------------
    def _record(self, step: int, ops: list[sdk.Op], times: sdk.StepTimes) -> None:
        for r, events in enumerate(sdk.events_by_rank(ops, self.cfg.num_ranks)):
            batch = self.ranks[r].record_step(step, events, times)
            if batch:
                self.shipped.append((float(times.end[r] + self._ship_lag[r]), batch))

    # -- what the collector receives ----------------------------------------------------------
    def run(self) -> None:
        """Every step, or until a hang stops the job."""
        while self.steps_done < self.cfg.num_steps:
            self.step()
            if self.hang is not None:  # the ranks that got through go on, into the next step
                if self.steps_done < self.cfg.num_steps:
                    self.step()
                return

    def heartbeat(self, rank: int, true_s: float) -> schema.Heartbeat:
        """What rank's flusher would send at `true_s`, read off its progress page."""
        return self.ranks[rank].heartbeat(true_s)

    def heartbeats(self, start_s: float, end_s: float) -> Iterator[tuple[float, schema.Heartbeat]]:
        """(true send time, heartbeat) of every rank's flusher ticks in [start_s, end_s), time
        ordered; each is lost with probability `heartbeat_loss`."""
        cfg = self.cfg
        interval = cfg.heartbeat_interval_s
        phase = np.random.default_rng(cfg.seed + 1).uniform(0, interval, cfg.num_ranks)
        lost = np.random.default_rng(cfg.seed + 2)
        first = np.floor((start_s - phase) / interval) + 1
        ticks = []
        for r in range(cfg.num_ranks):
            for k in itertools.count(int(first[r])):
                t = float(phase[r] + k * interval)
                if t >= end_s:
                    break
                if lost.random() >= cfg.heartbeat_loss:
                    ticks.append((t, r))
        ticks.sort()
        for t, r in ticks:
            yield t, self.heartbeat(r, t)

    def all_records(self) -> list[schema.Record]:
        """Everything the job shipped, heartbeats included (what `vigil analyze` would read)."""
        out = [*self.records, *(r for _t, batch in self.shipped for r in batch)]
        start = float(min(rank.page.data_spans[0][0] for rank in self.ranks))
        out.extend(hb for _t, hb in self.heartbeats(start, self.end_s() + 0.01))
        return out

    def end_s(self) -> float:
        """True time the last rank ended its last recorded step."""
        ends = [rank.page.step_end[-1] for rank in self.ranks if rank.page.step_end]
        return max(ends, default=0.0)


def run(cfg: JobConfig) -> Job:
    job = Job(cfg)
    job.run()
    return job
