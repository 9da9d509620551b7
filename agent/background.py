"""The background half of an SDK session: what the flusher thread does once per interval.

The training thread (`session.py`) keeps each ended step as raw numbers; here, off that thread,
their step records and collective aggregates are built (a tensor loss is read, which may sync
a device), overlapped ops launched since (DDP's buckets) are put on the progress page, steps
whose collectives still run on a CUDA device are held until they end, a heartbeat is queued,
peak memory is read, and the process's own hang suspicion is checked with the node agent's
`Watchdog` (the same rule: no progress for `hang_factor` x the slowest recent step, at least
`min_hang_s`): then the ring buffer and thread stacks are dumped.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vigil import schema
from vigil.agent import collectives, config, progress, sinks, watchdog
from vigil.agent.phases import PhaseSums

log = logging.getLogger(__name__)

# How long an ended step's records wait for its collectives still running on a CUDA device.
CUDA_SETTLE_S = 5.0
# Before its first step a process may load data and compile for a long time.
_STARTUP_GRACE_S = 600.0


class EndedStep(NamedTuple):
    """What the training thread keeps of an ended step until the flusher builds its records."""

    step: int
    start: float
    end: float
    tokens: int
    loss: Any  # a number, a detached scalar tensor or None
    phases: PhaseSums
    blocked_s: float
    aggs: collectives.StepAggregates
    spans: dict[str, float]
    mfu: float
    cpu_wait_s: float = 0.0  # the training thread's wait for a CPU over the step (cpuwait.py)
    # On CUDA: (launch event, end event, device) of each "data" span (see `data_time`).
    data_events: tuple[tuple[Any, Any, int], ...] = ()


class Background:
    """Owned by the session; `tick` is the flusher's periodic callback."""

    def __init__(
        self,
        *,
        cfg: config.SdkConfig,
        queue: sinks.RecordQueue,
        recorder: collectives.CollectiveRecorder,
        page_path: Path,
        ended: collections.deque[EndedStep],
        clock: Callable[[], float],
        wall_offset_s: float,
        flops_per_token: Callable[[], float | None],
        cuda_device: Callable[[], int | None],
        write_health: Callable[[], None],
        dump_evidence: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self._queue = queue
        self._recorder = recorder
        self._page_path = page_path
        self._ended = ended
        self._clock = clock
        self._wall_offset = wall_offset_s
        self._flops_per_token = flops_per_token
        self._cuda_device = cuda_device
        self._write_health = write_health
        self._dump_evidence = dump_evidence
        self._reader: progress.PageReader | None = None  # the flusher thread's own
        self.watchdog = watchdog.Watchdog(
            hang_factor=cfg.hang_factor,
            min_hang_s=cfg.min_hang_s,
            startup_grace_s=_STARTUP_GRACE_S,
        )
        # The CUDA allocator's peak on the training thread's device, else host RSS, read here
        # each interval: on the training thread it costs tens of microseconds, and it only grows.
        self.peak_memory_bytes = peak_memory(None)

    def tick(self) -> None:
        self.peak_memory_bytes = peak_memory(self._cuda_device())
        self.settle()
        if self._reader is None:
            self._reader = progress.PageReader(self._page_path)
        snap = self._reader.snapshot()
        cfg = self.cfg
        self._queue.put(
            schema.Heartbeat(
                job_id=cfg.job,
                rank=cfg.rank,
                # The step records' clock (monotonic + the offset taken at start), so that a
                # wall clock stepped meanwhile (NTP) cannot make silence out of progress.
                time_s=self._clock() + self._wall_offset,
                last_step=snap.last_step,
                last_group=snap.last_group,
                last_seq=snap.last_seq,
                last_op=snap.last_op,
                state=snap.state,
                checkpoints=snap.checkpoints,
                between_steps=snap.between_steps,
                compiling=snap.compiling,
            )
        )
        self._check_hang(snap)
        self._write_health()

    def _check_hang(self, snap: progress.PageSnapshot) -> None:
        suspect = self.watchdog.observe(snap, self._clock())
        if suspect is None:
            return
        log.warning(
            "no progress for %.1f s (step %d, last %s #%d %s): dumping ring and stacks",
            suspect.stalled_s,
            snap.last_step,
            snap.last_group,
            snap.last_seq,
            snap.last_op,
        )
        self._dump_evidence(f"no progress for {suspect.stalled_s:.1f} s")

    def settle(self, *, final: bool = False) -> None:
        """Queue the records of the steps ended since the last call, in step order. A step
        whose collectives still run on a CUDA device waits for them (up to `CUDA_SETTLE_S`;
        `final`: not at all), so that their device time counts in the step that launched them."""
        if final:
            self.peak_memory_bytes = peak_memory(self._cuda_device())
        cfg = self.cfg
        ended = self._ended
        now = self._clock()
        self._recorder.resolve_cuda()  # once for all the steps below
        self._recorder.publish()  # the overlapped ops launched since, with the ends just read
        flops_per_token = self._flops_per_token() or 0.0
        while ended:
            e = ended[0]
            late = final or now - e.end > CUDA_SETTLE_S
            data_s = data_time(e.spans.get("data", 0.0), e.data_events, late=late)
            if data_s is None or not self._recorder.release(e.step, force=late):
                break  # the next interval
            ended.popleft()
            spans, phases = e.spans, e.phases
            self._queue.put(
                schema.StepRecord(
                    job_id=cfg.job,
                    rank=cfg.rank,
                    step=e.step,
                    start_s=e.start + self._wall_offset,
                    end_s=e.end + self._wall_offset,
                    data_s=data_s,
                    forward_s=phases.forward_s + spans.get("forward", 0.0),
                    backward_s=phases.backward_s + spans.get("backward", 0.0),
                    optimizer_s=phases.optimizer_s + spans.get("optimizer", 0.0),
                    comm_wait_s=e.blocked_s + collectives.exposed_s(e.aggs),
                    tokens=max(0, e.tokens),
                    model_flops=flops_per_token * e.tokens,
                    mfu=e.mfu,
                    loss=loss_value(e.loss),
                    peak_memory_bytes=self.peak_memory_bytes,
                    cpu_wait_s=e.cpu_wait_s,
                    # Unknown (0) where a "forward" span timed part of the forward time.
                    forward_cpu_wait_s=0.0 if "forward" in spans else phases.forward_cpu_wait_s,
                    pipeline_s=phases.pipeline_s,
                    pipeline_cpu_wait_s=phases.pipeline_cpu_wait_s,
                    pipeline_comm_wait_s=phases.pipeline_comm_wait_s,
                    stage_backward_s=phases.stage_backward_s,
                    stage_backward_wait_s=phases.stage_backward_wait_s,
                )
            )
            self._queue.extend(
                collectives.aggregate_records(e.aggs, job=cfg.job, rank=cfg.rank, step=e.step)
            )

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


def loss_value(loss: Any) -> float | None:
    """A finite float, or None when unknown (a tensor is read here, off the training thread)."""
    if loss is None:
        return None
    try:
        value = float(loss)
    except Exception:
        return None
    return value if math.isfinite(value) else None


def data_time(
    host_s: float, events: tuple[tuple[Any, Any, int], ...], *, late: bool
) -> float | None:
    """A step's data-loading time. On the host: its "data" spans' time. On CUDA, where the
    host runs ahead of the device, a span can also hold the host's wait for the device (a
    copy from pageable memory first waits for the stream's queued kernels): that is the
    rank's compute, and its device-side slowness would read as a data stall. The device
    time from a span's launch event to its end event leaves it out (the launch event
    completes when the stream has drained), and is no more than the host's time when the
    device was idle throughout, a real stall: the smaller of the two sums counts. None while
    an end event is pending and not `late` (then the host's time counts)."""
    if not events:
        return host_s
    device_s = 0.0
    for start, end, device in events:
        seconds = collectives.device_elapsed(start, end, device)
        if seconds is None:
            return host_s if late else None
        device_s += seconds
    return min(host_s, device_s)


def peak_memory(cuda_device: int | None) -> int:
    if cuda_device is not None:
        return int(torch.cuda.max_memory_allocated(cuda_device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def device_uuid() -> str:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        with contextlib.suppress(Exception):
            return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return ""
