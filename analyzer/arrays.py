"""Step x rank matrices that every detector works on, and their construction from wire records.

`StepArrays` holds one job's per-step, per-rank timings as float32 matrices shaped [steps, ranks]
(NaN = not reported). The test simulator (tests/support/) produces them directly; `from_records`
builds them from SDK records (StepRecord, CollectiveAggregate, RankInfo, Job, Sample). Pure: no
I/O.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import attribution

F32 = npt.NDArray[np.float32]

# NVML clocks-event (throttle) reason bits that mean the GPU is being slowed against its will:
# SwPowerCap 0x4, HwSlowdown 0x8, SwThermalSlowdown 0x20, HwThermalSlowdown 0x40,
# HwPowerBrakeSlowdown 0x80. Idle (0x1), application clocks (0x2), sync boost (0x10) and display
# clocks (0x100) are benign.
HARMFUL_THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def is_sm_clock_metric(metric: str) -> bool:
    """NVML SM clock readings, whatever unit suffix the agent gave them."""
    name = metric.lower()
    return "clock" in name and "sm" in name


def is_throttle_metric(metric: str) -> bool:
    name = metric.lower()
    return "throttle" in name or "clocks_event" in name


@dataclass(kw_only=True)
class StepArrays:
    """One job's steps (rows) x ranks (columns); see the module docstring."""

    job_id: str
    steps: npt.NDArray[np.int64]
    ranks: npt.NDArray[np.int64]
    step_time_s: F32
    data_s: F32
    comm_wait_s: F32  # exposed: the SDK's blocked time plus the waits it cannot see (DDP's)
    transfer_s: F32  # collectives' own time, nobody waited for (attribution.py); NaN if unknown
    tokens: F32
    mfu: F32
    step_start_s: npt.NDArray[np.float64]  # earliest start among ranks, per step
    step_end_s: npt.NDArray[np.float64]  # latest end among ranks, per step
    nodes: tuple[str, ...]
    devices: tuple[str, ...] = ()  # device UUID per rank ("" unknown); empty when none known
    stages: npt.NDArray[np.int32] | None = None
    sm_clock_hz: F32 | None = None
    throttled: F32 | None = None  # 1 where a harmful NVML throttle reason was active
    # Time waiting in collectives for the last arrival, attributed across ranks; None unknown.
    wait_s: F32 | None = None
    # The collective aggregates behind the attributed fields (rows and columns index these
    # arrays) and the (group, op class) each `key` stands for: the slow-link detector reads them.
    aggs: attribution.AggColumns | None = None
    agg_keys: tuple[tuple[str, str], ...] = ()
    # Or, in their place, what the slow-link detector reads of them: per (row, key) cell its
    # transfer time (`attribution.group_transfer`), kept per row by the streaming window.
    transfers: attribution.GroupTransfer | None = None
    # The training thread's wait for a CPU (StepRecord.cpu_wait_s; 0 unknown); None: not known.
    cpu_wait_s: F32 | None = None
    # The forward pass's time as the SDK's module hooks measured it (StepRecord.forward_s; 0
    # where no model was watched); None: not known.
    forward_s: F32 | None = None
    # The part of cpu_wait_s inside those forward passes (StepRecord.forward_cpu_wait_s; 0
    # unknown); None: not known.
    forward_cpu_wait_s: F32 | None = None
    # A pipeline stage's own time outside its schedule (`pipeline_own`); NaN where no pipeline
    # schedule was timed; None: not known.
    pipeline_own_s: F32 | None = None
    # A pipeline stage's own time in its backward passes (`stage_backward_own`); NaN where
    # none was timed; None: not known.
    stage_backward_own_s: F32 | None = None
    _compute: F32 | None = field(default=None, repr=False, compare=False)
    _known_compute: F32 | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = (self.steps.size, self.ranks.size)
        for name in ("step_time_s", "data_s", "comm_wait_s", "transfer_s", "tokens", "mfu"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, expected {shape}")
        if len(self.nodes) != self.ranks.size:
            raise ValueError(f"nodes names {len(self.nodes)} ranks, expected {self.ranks.size}")

    @property
    def num_steps(self) -> int:
        return int(self.steps.size)

    @property
    def num_ranks(self) -> int:
        return int(self.ranks.size)

    def compute_s(self) -> F32:
        """Compute time per rank and step: step time minus exposed comm wait, data time and
        the training thread's wait for a CPU (the host's time, not the rank's work: on a host
        with more busy threads than cores it is most of the ranks' step-to-step spread).

        Computed once and cached: treat the arrays as read-only after the first call.
        """
        if self._compute is None:
            self._compute = np.maximum(self._remainder(), 0.0)
        return self._compute

    def known_compute_s(self) -> F32:
        """`compute_s`, but NaN (unknown) where it was clipped at 0 while the rank waited for
        a CPU: its communication wait, data time and CPU wait then add up to more than its
        step, so the CPU wait overlapped the communication wait (a thread woken inside a
        collective waits for a CPU there too) and how much of the step was compute is not
        known. Read as 0, peers starved inside their collectives compute nothing, and the one
        rank that was not starved looks slow (a clean job with a busy process on every core:
        a rank computing 1.6x its usual read as 4.2x its peers' median). The straggler scores
        read this; cached as `compute_s` is.
        """
        if self._known_compute is None:
            compute = self.compute_s()
            if self.cpu_wait_s is not None:
                overlapped = (self._remainder() < 0) & (np.nan_to_num(self.cpu_wait_s) > 0)
                if overlapped.any():
                    compute = np.where(overlapped, np.float32(np.nan), compute)
            self._known_compute = compute
        return self._known_compute

    def _remainder(self) -> F32:
        """Step time minus exposed comm wait, data time and CPU wait, unclipped."""
        out = self.step_time_s - self.comm_wait_s - self.data_s
        if self.cpu_wait_s is not None:
            out -= np.nan_to_num(self.cpu_wait_s)
        return out

    def job_mfu(self) -> npt.NDArray[np.float64]:
        """Per-step MFU of the job (mean over ranks); falls back to throughput when MFU is 0."""
        mfu = self._mean_mfu()
        return mfu if np.nansum(mfu) > 0 else self._throughput()

    def step_mfu(self) -> npt.NDArray[np.float64]:
        """`job_mfu()` of each step alone (the throughput fallback decided step by step)."""
        mfu = self._mean_mfu()
        values: npt.NDArray[np.float64] = np.where(np.nan_to_num(mfu) > 0, mfu, self._throughput())
        return values

    def _mean_mfu(self) -> npt.NDArray[np.float64]:
        with np.errstate(all="ignore"):
            mfu: npt.NDArray[np.float64] = np.nanmean(self.mfu, axis=1, dtype=np.float64)
        return mfu

    def _throughput(self) -> npt.NDArray[np.float64]:
        """The job's tokens per second of each step: its ranks' mean tokens times the ranks,
        over its slowest rank's step time. A step whose records are not all in yet (the
        streaming analyzer moves on once newer steps crowd its window, and a job of fast steps
        analyses steps before a rank's next flush) is read from the ranks it has: their sum
        alone would read the missing ranks' tokens as a drop in throughput."""
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a step no rank reported: NaN
            tokens = np.nanmean(self.tokens, axis=1, dtype=np.float64) * self.num_ranks
            time = np.nanmax(self.step_time_s, axis=1).astype(np.float64)
            rate: npt.NDArray[np.float64] = np.where(time > 0, tokens / time, np.nan)
        return rate


def stages_for_layout(
    layout: schema.ParallelLayout, world_size: int
) -> npt.NDArray[np.int32] | None:
    """Pipeline stage of each rank, with Megatron's default order (pipeline is the slowest dim)."""
    if layout.pp <= 1 or world_size % layout.pp:
        return None
    per_stage = world_size // layout.pp
    return (np.arange(world_size, dtype=np.int32) // per_stage).astype(np.int32)


def from_records(records: Iterable[schema.Record], *, job_id: str | None = None) -> StepArrays:
    """Build one job's arrays from its records; other jobs' records are ignored."""
    steps: list[schema.StepRecord] = []
    aggs: list[schema.CollectiveAggregate] = []
    infos: dict[int, schema.RankInfo] = {}
    samples: list[schema.Sample] = []
    job: schema.Job | None = None
    for record in records:
        rec_job = getattr(record, "job_id", None)
        if job_id is None and rec_job and not isinstance(record, schema.Sample):
            job_id = rec_job
        if rec_job not in (job_id, "", None):
            continue
        if isinstance(record, schema.StepRecord):
            steps.append(record)
        elif isinstance(record, schema.CollectiveAggregate):
            aggs.append(record)
        elif isinstance(record, schema.RankInfo):
            infos[record.rank] = record
        elif isinstance(record, schema.Sample):
            samples.append(record)
        elif isinstance(record, schema.Job):
            job = record
    if not steps:
        raise ValueError(f"no step records for job {job_id!r}")
    return _assemble(str(job_id), steps, aggs, infos, samples, job)


def pipeline_own(
    step_time: npt.NDArray[np.float64],
    data: npt.NDArray[np.float64],
    comm_wait: npt.NDArray[np.float64],
    cpu_wait: npt.NDArray[np.float64],
    pipeline: npt.NDArray[np.float64],
) -> npt.NDArray[np.float64]:
    """A pipeline stage's own time outside its schedule, per step record: its step less the
    time inside pipeline schedules (`pipeline` columns: StepRecord.pipeline_s,
    pipeline_cpu_wait_s, pipeline_comm_wait_s), its data time, and its waits outside the
    schedule (blocked in collectives, e.g. a gradient norm's all-reduce across stages; waiting
    for a CPU). A stage waits for its peers inside its schedule: a peer slowed elsewhere makes
    it wait there, not here. NaN where no schedule was timed (0 inside)."""
    inside, inside_cpu, inside_comm = pipeline[:, 0], pipeline[:, 1], pipeline[:, 2]
    outside_waits = np.fmax(comm_wait - inside_comm, 0.0) + np.fmax(cpu_wait - inside_cpu, 0.0)
    own = np.fmax(step_time - inside - data - outside_waits, 0.0)
    return np.where(inside > 0, own, np.nan)


def stage_backward_own(
    backward: npt.NDArray[np.float64], waits: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """A pipeline stage's own time in its backward passes, per step record: their time
    (StepRecord.stage_backward_s) less its waits there for a CPU and in collectives
    (stage_backward_wait_s). The schedule receives a chunk's gradients before the chunk's
    backward runs: a peer slowed anywhere makes the stage wait outside these. NaN where none
    was timed (0)."""
    return np.where(backward > 0, np.fmax(backward - waits, 0.0), np.nan)


def _assemble(
    job_id: str,
    steps: Sequence[schema.StepRecord],
    aggs: Sequence[schema.CollectiveAggregate],
    infos: dict[int, schema.RankInfo],
    samples: Sequence[schema.Sample],
    job: schema.Job | None,
) -> StepArrays:
    raw = np.array(
        [
            (
                s.rank,
                s.step,
                s.start_s,
                s.end_s,
                s.data_s,
                s.comm_wait_s,
                s.tokens,
                s.mfu,
                s.model_flops,
                s.cpu_wait_s,
                s.forward_s,
                s.forward_cpu_wait_s,
                s.pipeline_s,
                s.pipeline_cpu_wait_s,
                s.pipeline_comm_wait_s,
                s.stage_backward_s,
                s.stage_backward_wait_s,
            )
            for s in steps
        ],
        dtype=np.float64,
    )
    rank_ids = np.unique(raw[:, 0].astype(np.int64))
    if job is not None:
        rank_ids = np.union1d(rank_ids, np.arange(job.world_size, dtype=np.int64))
    step_ids = np.unique(raw[:, 1].astype(np.int64))
    r = np.searchsorted(rank_ids, raw[:, 0].astype(np.int64))
    s = np.searchsorted(step_ids, raw[:, 1].astype(np.int64))
    shape = (step_ids.size, rank_ids.size)

    def scatter(values: npt.NDArray[np.float64]) -> F32:
        out = np.full(shape, np.nan, dtype=np.float32)
        out[s, r] = values
        return out

    step_time = raw[:, 3] - raw[:, 2]
    mfu = raw[:, 7]
    peak = job.peak_flops if job is not None else 0.0
    if peak > 0:
        derived = np.where(step_time > 0, raw[:, 8] / np.maximum(step_time, 1e-12) / peak, 0.0)
        mfu = np.where(mfu > 0, mfu, derived)
    start = np.full(step_ids.size, np.inf)
    end = np.full(step_ids.size, -np.inf)
    np.minimum.at(start, s, raw[:, 2])
    np.maximum.at(end, s, raw[:, 3])
    nodes = tuple(infos[int(x)].node if int(x) in infos else "" for x in rank_ids)
    devices = tuple(infos[int(x)].device_uuid if int(x) in infos else "" for x in rank_ids)
    stages = None
    if job is not None and rank_ids.size == job.world_size:
        stages = stages_for_layout(job.layout, job.world_size)
    keys: dict[tuple[str, str], int] = {}
    agg_cols = attribution.columns_of(
        aggs,
        {int(x): i for i, x in enumerate(step_ids)},
        {int(x): i for i, x in enumerate(rank_ids)},
        keys,
    )
    attributed = attribution.attribute(agg_cols, shape)
    arrays = StepArrays(
        job_id=job_id,
        steps=step_ids,
        ranks=rank_ids,
        step_time_s=scatter(step_time),
        data_s=scatter(raw[:, 4]),
        comm_wait_s=scatter(raw[:, 5]) + np.nan_to_num(attributed.hidden_wait_s),
        transfer_s=attributed.transfer_s,
        wait_s=attributed.wait_s,
        aggs=agg_cols,
        agg_keys=tuple(sorted(keys, key=keys.__getitem__)),
        tokens=scatter(raw[:, 6]),
        mfu=scatter(mfu),
        cpu_wait_s=scatter(raw[:, 9]),
        forward_s=scatter(raw[:, 10]),
        forward_cpu_wait_s=scatter(raw[:, 11]),
        pipeline_own_s=scatter(
            pipeline_own(step_time, raw[:, 4], raw[:, 5], raw[:, 9], raw[:, 12:15])
        ),
        stage_backward_own_s=scatter(stage_backward_own(raw[:, 15], raw[:, 16])),
        step_start_s=start,
        step_end_s=end,
        nodes=nodes,
        devices=devices if any(devices) else (),
        stages=stages,
    )
    if samples:
        _attach_samples(arrays, samples, infos, scatter(raw[:, 3]))
    return arrays


def _attach_samples(
    arrays: StepArrays,
    samples: Sequence[schema.Sample],
    infos: dict[int, schema.RankInfo],
    end_s: F32,
) -> None:
    """Average SM clocks and OR harmful throttle bits into the step each sample fell in."""
    by_device = {(i.node, i.device_uuid): rank for rank, i in infos.items() if i.device_uuid}
    col = {int(rank): i for i, rank in enumerate(arrays.ranks)}
    clock_sum = np.zeros(end_s.shape)
    clock_n = np.zeros(end_s.shape)
    throttled = np.zeros(end_s.shape, dtype=np.float32)
    for sample in samples:
        rank = sample.rank if sample.rank >= 0 else by_device.get((sample.node, sample.device), -1)
        c = col.get(rank)
        if c is None:
            continue
        ends = end_s[:, c]
        row = int(np.searchsorted(np.nan_to_num(ends, nan=np.inf), sample.time_s))
        if row >= ends.size:
            continue
        if is_sm_clock_metric(sample.metric):
            clock_sum[row, c] += sample.value
            clock_n[row, c] += 1
        elif is_throttle_metric(sample.metric) and int(sample.value) & HARMFUL_THROTTLE_BITS:
            throttled[row, c] = 1.0
    if clock_n.any():
        with np.errstate(invalid="ignore"):
            arrays.sm_clock_hz = (clock_sum / clock_n).astype(np.float32)
    arrays.throttled = throttled
