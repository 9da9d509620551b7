"""A seeded fault-scenario simulator: multi-rank step, collective and heartbeat streams.

Synchronous data-parallel training of N ranks (8 per node by default), each step: data loading,
compute, `tp_collectives` collectives inside the node's tensor-parallel group ("tp<node>"),
then one all-reduce over the data-parallel group "dp". Measurement model (what the SDK reports):
`comm_wait_s` is all exposed communication time after the rank's compute (waiting for the slowest
peer plus the transfer itself); a collective aggregate's `total_wait_s` is the waiting part and
`total_device_s - total_wait_s` the rank's own transfer time.

Noise: a fixed per-rank speed spread, a per-step job-wide swing (input variance), per rank-step
jitter and rare heavy-tailed hiccups (GC pauses, page faults). Faults: straggler of factor f, hang
at (step, rank, collective), slow link between two nodes, GPU throttling (clocks and NVML
throttle reasons drop with compute), data stall, pipeline-stage and sequence-length imbalance.

This is the analyzer's own measurement model written straight into `StepArrays` (each rank's
wait is the slowest arrival minus its own, the true transfer time is passed in, positions and
heartbeats are perfect): detector unit tests use it, and `bench/detect.py` uses it only as the
input of its scale figures. Detection quality is measured on `observed.py`, which models what
ranks do and lets the SDK's own code measure it.

Pure and deterministic for a given seed: no clocks, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import arrays as arrays_mod

NOMINAL_MFU = 0.45
SM_CLOCK_HZ = 1.98e9
THROTTLE_HW_THERMAL = 0x40


class FaultKind(enum.StrEnum):
    STRAGGLER = "straggler"
    HANG = "hang"
    SLOW_LINK = "slow_link"
    THROTTLE = "throttle"
    DATA_STALL = "data_stall"
    STAGE_IMBALANCE = "stage_imbalance"
    SEQLEN_IMBALANCE = "seqlen_imbalance"


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault. Which fields matter depends on `kind` (see `ScenarioConfig`)."""

    kind: FaultKind
    start_step: int = 0
    ranks: tuple[int, ...] = ()  # straggler, throttle, data stall (empty = every rank)
    factor: float = 1.0  # slowdown factor (straggler, slow link, stage) or clock ratio (throttle)
    extra_s: float = 0.0  # data stall: extra data-loading seconds per step
    nodes: tuple[int, int] = (0, 1)  # slow link endpoints
    rank: int = 0  # hang culprit
    collective: int = 0  # hang: index of the collective within the step
    stage: int = 0  # stage imbalance: the slow pipeline stage

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"fault factor must be > 0, got {self.factor}")
        if self.start_step < 0 or self.extra_s < 0:
            raise ValueError("fault start_step and extra_s must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ScenarioConfig:
    """A simulated job: its size, timings, noise and faults."""

    job_id: str = "sim"
    num_ranks: int
    num_steps: int
    ranks_per_node: int = 8
    pp: int = 1
    compute_s: float = 0.8
    data_s: float = 0.03
    transfer_s: float = 0.12
    tokens_per_rank: int = 8192
    rank_spread: float = 0.01  # sigma of the fixed per-rank speed (lognormal)
    step_swing: float = 0.02  # sigma of the per-step job-wide factor
    jitter: float = 0.015  # sigma of per rank-step noise
    hiccup_rate: float = 2e-5  # probability of a heavy-tailed pause per rank-step
    tp_collectives: int = 2
    heartbeat_interval_s: float = 1.0
    start_time_s: float = 1.8e9
    faults: tuple[Fault, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_steps < 1:
            raise ValueError("num_ranks and num_steps must be >= 1")
        if self.ranks_per_node < 1 or self.pp < 1 or self.num_ranks % self.pp:
            raise ValueError("ranks_per_node must be >= 1 and pp must divide num_ranks")
        if min(self.compute_s, self.transfer_s) <= 0 or self.data_s < 0:
            raise ValueError("compute_s and transfer_s must be > 0, data_s >= 0")
        hangs = [f for f in self.faults if f.kind is FaultKind.HANG]
        if len(hangs) > 1:
            raise ValueError("at most one hang per scenario")
        for fault in self.faults:
            bad = [r for r in (*fault.ranks, fault.rank) if not 0 <= r < self.num_ranks]
            if bad:
                raise ValueError(f"fault ranks {bad} outside 0..{self.num_ranks - 1}")
        if hangs and not 0 <= hangs[0].collective <= self.tp_collectives:
            raise ValueError(f"hang collective must be in 0..{self.tp_collectives}")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_ranks // self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True, kw_only=True)
class HangTruth:
    step: int
    rank: int
    group: str
    seq: int
    op: str
    onset_s: float


@dataclass(kw_only=True)
class Simulation:
    """What a scenario produced: the completed steps as arrays, and the ground truth."""

    config: ScenarioConfig
    arrays: arrays_mod.StepArrays
    start_s: npt.NDArray[np.float64]  # [steps] start of each step (identical on every rank)
    hang: HangTruth | None = None
    affected_ranks: frozenset[int] = field(default_factory=frozenset)

    def node_name(self, rank: int) -> str:
        return f"node{self.config.node_of(rank):04d}"

    def positions_at(self, time_s: float) -> list[schema.Heartbeat]:
        """Every rank's heartbeat at `time_s` (after the last completed step)."""
        cfg = self.config
        done = self.arrays.num_steps  # steps 0..done-1 completed
        beats = []
        for rank in range(cfg.num_ranks):
            group, seq, op, state = self._position(rank, done)
            beats.append(
                schema.Heartbeat(
                    job_id=cfg.job_id,
                    rank=rank,
                    time_s=time_s,
                    last_step=done - 1,
                    last_group=group,
                    last_seq=seq,
                    last_op=op,
                    state=state,
                )
            )
        return beats

    def _position(self, rank: int, done: int) -> tuple[str, int, str, schema.RankState]:
        cfg, hang = self.config, self.hang
        n_tp = cfg.tp_collectives
        tp = f"tp{cfg.node_of(rank)}"
        if hang is None:
            return "dp", done, "all_reduce", schema.RankState.COMPUTE
        s, c = hang.step, _hang_fault(cfg).collective
        if rank == hang.rank:  # never enters collective c of step s
            if c == 0:
                return "dp", s, "all_reduce", schema.RankState.COMPUTE
            return tp, s * n_tp + c, "all_gather", schema.RankState.COMPUTE
        waiting = schema.RankState.IN_COLLECTIVE
        if c < n_tp and cfg.node_of(rank) == cfg.node_of(hang.rank):
            return tp, s * n_tp + c + 1, "all_gather", waiting
        return "dp", s + 1, "all_reduce", waiting

    def records(self) -> Iterator[list[schema.Record]]:
        """Per-step batches of wire records (RankInfo/Job first), in time order."""
        cfg, a = self.config, self.arrays
        layout = schema.ParallelLayout(dp=cfg.num_ranks // cfg.pp, pp=cfg.pp)
        yield [
            schema.Job(job_id=cfg.job_id, world_size=cfg.num_ranks, layout=layout),
            *(
                schema.RankInfo(
                    job_id=cfg.job_id,
                    rank=r,
                    node=self.node_name(r),
                    local_rank=r % cfg.ranks_per_node,
                    device_uuid=f"GPU-{r:08d}",
                )
                for r in range(cfg.num_ranks)
            ),
        ]
        for i in range(a.num_steps):
            yield self.step_records(i)

    def step_records(self, i: int) -> list[schema.Record]:
        """The records of completed step index `i`: steps, collective aggregates, heartbeats."""
        cfg, a = self.config, self.arrays
        start = float(self.start_s[i])
        out: list[schema.Record] = []
        n_tp = cfg.tp_collectives
        for r in range(cfg.num_ranks):
            step_time = float(a.step_time_s[i, r])
            wait = float(a.comm_wait_s[i, r])
            transfer = float(a.transfer_s[i, r])
            compute = step_time - wait - float(a.data_s[i, r])
            out.append(
                schema.StepRecord(
                    job_id=cfg.job_id,
                    rank=r,
                    step=i,
                    start_s=start,
                    end_s=start + step_time,
                    data_s=float(a.data_s[i, r]),
                    forward_s=compute / 3,
                    backward_s=compute * 2 / 3,
                    comm_wait_s=wait,
                    tokens=int(a.tokens[i, r]),
                    mfu=float(a.mfu[i, r]),
                )
            )
            out.append(
                schema.CollectiveAggregate(
                    job_id=cfg.job_id,
                    rank=r,
                    step=i,
                    group="dp",
                    op="all_reduce",
                    count=1,
                    total_device_s=max(wait, transfer),
                    max_device_s=max(wait, transfer),
                    total_wait_s=max(wait - transfer, 0.0),
                    last_seq=i + 1,
                )
            )
            if n_tp:
                out.append(
                    schema.CollectiveAggregate(
                        job_id=cfg.job_id,
                        rank=r,
                        step=i,
                        group=f"tp{cfg.node_of(r)}",
                        op="all_gather",
                        count=n_tp,
                        last_seq=(i + 1) * n_tp,
                    )
                )
            if a.sm_clock_hz is not None:
                out.append(
                    schema.Sample(
                        node=self.node_name(r),
                        device=f"GPU-{r:08d}",
                        time_s=start + step_time / 2,
                        metric="sm_clock_hertz",
                        value=float(a.sm_clock_hz[i, r]),
                        job_id=cfg.job_id,
                        rank=r,
                    )
                )
                if a.throttled is not None and a.throttled[i, r] > 0:
                    out.append(
                        schema.Sample(
                            node=self.node_name(r),
                            device=f"GPU-{r:08d}",
                            time_s=start + step_time / 2,
                            metric="clocks_throttle_reasons",
                            value=float(THROTTLE_HW_THERMAL),
                            job_id=cfg.job_id,
                            rank=r,
                        )
                    )
        end = start + float(np.nanmax(a.step_time_s[i]))
        out.extend(
            schema.Heartbeat(
                job_id=cfg.job_id,
                rank=r,
                time_s=end,
                last_step=i,
                last_group="dp",
                last_seq=i + 1,
                last_op="all_reduce",
            )
            for r in range(cfg.num_ranks)
        )
        return out


def _hang_fault(cfg: ScenarioConfig) -> Fault:
    return next(f for f in cfg.faults if f.kind is FaultKind.HANG)


def simulate(config: ScenarioConfig) -> Simulation:
    """Run a scenario: steps until its end or until a hang stops progress."""
    cfg = config
    rng = np.random.default_rng(cfg.seed)
    hang = next((f for f in cfg.faults if f.kind is FaultKind.HANG), None)
    steps = cfg.num_steps if hang is None else min(cfg.num_steps, hang.start_step)
    shape = (steps, cfg.num_ranks)
    f32 = np.float32

    rank_speed = rng.lognormal(0.0, cfg.rank_spread, cfg.num_ranks).astype(f32)
    swing = rng.lognormal(0.0, cfg.step_swing, (steps, 1)).astype(f32)
    noise = rng.lognormal(0.0, cfg.jitter, shape).astype(f32)
    compute = (cfg.compute_s * swing) * noise
    compute *= rank_speed
    hiccups = rng.random(shape) < cfg.hiccup_rate
    compute[hiccups] *= rng.uniform(1.2, 2.5, int(hiccups.sum())).astype(f32)
    tokens = np.full(shape, cfg.tokens_per_rank, dtype=f32)
    data = (cfg.data_s * rng.lognormal(0.0, 0.1, shape)).astype(f32)
    transfer = (cfg.transfer_s * rng.lognormal(0.0, cfg.jitter, shape)).astype(f32)
    clock = np.full(shape, SM_CLOCK_HZ, dtype=f32) if _has(cfg, FaultKind.THROTTLE) else None
    throttled = np.zeros(shape, dtype=f32) if clock is not None else None
    stages = None
    if cfg.pp > 1:
        stages = (np.arange(cfg.num_ranks) // (cfg.num_ranks // cfg.pp)).astype(np.int32)

    affected: set[int] = set()
    for fault in cfg.faults:
        rows = slice(min(fault.start_step, steps), steps)
        ranks = list(fault.ranks) or list(range(cfg.num_ranks))
        if fault.kind is FaultKind.STRAGGLER:
            compute[rows, ranks] *= f32(fault.factor)
            affected.update(ranks)
        elif fault.kind is FaultKind.THROTTLE:
            assert clock is not None and throttled is not None
            compute[rows, ranks] /= f32(fault.factor)
            clock[rows, ranks] *= f32(fault.factor)
            throttled[rows, ranks] = 1.0
            affected.update(ranks)
        elif fault.kind is FaultKind.DATA_STALL:
            data[rows, ranks] += f32(fault.extra_s)
            affected.update(ranks)
        elif fault.kind is FaultKind.SLOW_LINK:
            on_link = [r for r in range(cfg.num_ranks) if cfg.node_of(r) in fault.nodes]
            transfer[rows, on_link] *= f32(fault.factor)
            affected.update(on_link)
        elif fault.kind is FaultKind.STAGE_IMBALANCE:
            if stages is None:
                raise ValueError("stage imbalance needs pp > 1")
            slow = np.flatnonzero(stages == fault.stage)
            compute[rows, slow] *= f32(fault.factor)
            affected.update(int(r) for r in slow)
        elif fault.kind is FaultKind.SEQLEN_IMBALANCE:
            ratio = rng.lognormal(0.0, 0.35, (steps, len(ranks))).astype(f32)[rows]
            tokens[rows, ranks] *= ratio
            compute[rows, ranks] *= ratio

    arrival = data + compute
    slowest = arrival.max(axis=1, keepdims=True)
    slowest_transfer = transfer.max(axis=1, keepdims=True)
    wait = (slowest - arrival) + slowest_transfer
    step_time = slowest + slowest_transfer + np.zeros_like(arrival)
    start = cfg.start_time_s + np.concatenate(([0.0], np.cumsum(step_time[:, 0], dtype=np.float64)))
    nominal = cfg.compute_s + cfg.data_s + cfg.transfer_s
    mfu = (NOMINAL_MFU * nominal / step_time * (tokens / cfg.tokens_per_rank)).astype(f32)
    nodes = tuple(f"node{cfg.node_of(r):04d}" for r in range(cfg.num_ranks))
    out = arrays_mod.StepArrays(
        job_id=cfg.job_id,
        steps=np.arange(steps, dtype=np.int64),
        ranks=np.arange(cfg.num_ranks, dtype=np.int64),
        step_time_s=step_time,
        data_s=data,
        comm_wait_s=wait,
        transfer_s=transfer,
        tokens=tokens,
        mfu=mfu,
        step_start_s=start[:-1],
        step_end_s=start[1:],
        nodes=nodes,
        devices=tuple(f"GPU-{r:08d}" for r in range(cfg.num_ranks)),
        stages=stages,
        sm_clock_hz=clock,
        throttled=throttled,
    )
    truth = None
    if hang is not None:
        truth = _hang_truth(cfg, hang, float(start[-1]))
        affected = {hang.rank}
    return Simulation(
        config=cfg, arrays=out, start_s=start[:-1], hang=truth, affected_ranks=frozenset(affected)
    )


def _has(cfg: ScenarioConfig, kind: FaultKind) -> bool:
    return any(f.kind is kind for f in cfg.faults)


def _hang_truth(cfg: ScenarioConfig, fault: Fault, onset_s: float) -> HangTruth:
    s, c = fault.start_step, fault.collective
    if c < cfg.tp_collectives:
        group, seq, op = (
            f"tp{cfg.node_of(fault.rank)}",
            s * cfg.tp_collectives + c + 1,
            "all_gather",
        )
    else:
        group, seq, op = "dp", s + 1, "all_reduce"
    return HangTruth(step=s, rank=fault.rank, group=group, seq=seq, op=op, onset_s=onset_s)
