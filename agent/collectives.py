"""The collective recorder: every torch.distributed op a training process issues, timed.

`patching.install()` routes the public functions of `torch.distributed` and `Work.wait` here;
DDP's gradient all-reduce reaches it through `ddp_hook.ddp_comm_hook`. This module holds the
recorder and the per-step aggregates it builds.

Per event: process group, per-group sequence number, op, bytes, dtype, enqueue/start/end. Events
go to the progress page's ring buffer; per-(group, op) aggregates are kept for the step record.
An overlapped op (DDP's gradient buckets, launched inside backward) reaches the page later,
through `publish` on the session's flusher thread (each `flush_interval_s`): a page write there
costs the training thread tens of microseconds a bucket with its caches cold, and such an op
neither blocks the training thread nor ends its step. Until then the page shows the rank's last
other op: an agent's reading of a rank that has since stopped is at most one interval behind.
Asynchronous ops are timed at completion through their Work's future (or their wait). On CUDA
every op is timed with events, read without blocking (`resolve_cuda`): one recorded on the
issuing stream at launch, one on the stream that is current where completion is observed. A
CUDA future completes, and calls back, as soon as its op is enqueued, but on a stream made to
wait for the op's kernels, and a wait makes the current stream wait for them, so that second
event marks the end on the device. A step's aggregates stay open to its ops still on the device
until `release`. On CPU the monotonic clock is used.

Exposed communication time (the step record's `comm_wait_s`): on CPU the training thread's time
blocked in synchronous ops and waits (`blocked_s`). On CUDA the device's instead (`exposed_s`),
not the host's time in the call or wait, which can hold the rank's own queued kernels too (gloo
on CUDA tensors first waits for the stream to reach the op): that is compute, and counting it as
wait hides a rank that is slow on its device; with NCCL the host does not wait at all. A
synchronous op's stream waits from its launch event to its end; an asynchronous op waited for
on the training thread (`Work.wait`, `wait_tensor`) exposes the time from an event recorded on
the waiting stream at the wait (`begin_device_wait`) to the op's end, nothing if the op ended
before the stream got there.

Every hook is fail-open: an internal error is counted and the original call proceeds untouched.
This module must not do I/O beyond the progress page, and never blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from vigil import schema
from vigil.agent import groups, progress

log = logging.getLogger(__name__)

# Durations kept per (group, op, bytes) to estimate the pure transfer time (their minimum).
_BASELINE_WINDOW = 32


@dataclasses.dataclass(slots=True)
class _Agg:
    count: int = 0
    nbytes: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    wait_s: float = 0.0
    last_seq: int = 0
    last_s: float = 0.0  # duration of the op with the highest sequence number
    exposed_s: float = 0.0  # CUDA ops' device time that a stream waited for (module docstring)


class _Site:
    """One (group, op[, peer]) a process issues: its names, encoded once for the progress page,
    its group's sequence counter (shared by the group's ops) and its recent durations per
    message size. `overlapped`: its ops run behind compute and the training thread waits for
    them where the SDK cannot see (DDP's gradient buckets, waited for inside DDP's C++ reducer).
    Hashed by identity."""

    __slots__ = ("baselines", "group", "group_b", "op", "op_b", "overlapped", "seqs")

    def __init__(
        self, group: str, op: str, seqs: Iterator[int], *, overlapped: bool = False
    ) -> None:
        self.group, self.op, self.overlapped = group, op, overlapped
        self.group_b, self.op_b = progress.encode_group(group), progress.encode_op(op)
        self.seqs = seqs
        self.baselines: dict[int, collections.deque[float]] = {}


@dataclasses.dataclass(slots=True)
class _Pending:
    index: int
    site: _Site
    seq: int
    nbytes: int
    start: float
    step: int
    cuda_start: Any = None  # the launch event on the op's CUDA device
    device: int = -1  # that device's index
    # CUDA: the event from which the op's time is exposed wait (a synchronous op's launch
    # event; the waiting stream's event at a wait), None while nothing waits for it.
    exposed_from: Any = None
    resolved: bool = False  # its device time has been read
    end_wall: float = 0.0  # its end (wall clock) once known; 0: still running


class CollectiveRecorder:
    """Per-process state: sequence numbers, the ring buffer cursor and per-step aggregates.

    `step` is the step that collectives are attributed to; the session sets it at each step's
    start."""

    def __init__(
        self,
        *,
        page: progress.PageWriter | None,
        on_error: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
        wall_offset_s: float | None = None,
    ) -> None:
        self._page = page
        self._on_error = on_error
        self._clock = clock
        self._wall = time.time() - clock() if wall_offset_s is None else wall_offset_s
        self._lock = threading.Lock()
        self.step = 0
        # (id(group), op) or (id(group), op, peer) -> site; a group's name is read once.
        self._sites: dict[tuple[Any, ...], _Site] = {}
        self._groups: dict[int, Any] = {}
        # Per group name: next() on a C iterator is atomic under the GIL, no lock on the hot path.
        self._seqs: dict[str, Iterator[int]] = {}
        self._aggs: dict[_Site, _Agg] = {}
        # Ended steps whose ops still run on a CUDA device: their aggregates stay open to those
        # ops until `release` (the session's flusher, before it builds the step's records).
        self._open: dict[int, dict[_Site, _Agg]] = {}
        self._on_device: collections.Counter[int] = collections.Counter()  # step -> ops
        self._indices = itertools.count()
        self._cuda_pending: list[tuple[_Pending, Any]] = []
        # Overlapped ops launched and not yet on the page (`publish`), with their dtypes; more
        # than the ring holds would lap their own slots there.
        self._later: collections.deque[tuple[_Pending, bytes]] = collections.deque(
            maxlen=page.capacity if page is not None else 0
        )
        self._publish_lock = threading.Lock()
        # Training-thread time blocked in sync ops (those timed on the host) and Work.wait.
        self.blocked_s = 0.0
        self.collective_s = 0.0
        self.training_thread = threading.get_ident()

    # -- naming ---------------------------------------------------------------------------
    def _site(
        self, key: tuple[Any, ...], group: Any, op: str, peer: int | None, overlapped: bool
    ) -> _Site:
        # Keyed by id(): the group is held so that its id is never reused by another object
        # (torch may hand out a fresh Python wrapper per call; holding one keeps it the one).
        self._groups[id(group)] = group
        name = _describe_group(group)
        if peer is not None:
            low, high = sorted((dist.get_rank(), peer))
            name = f"{name}:p2p:{low}-{high}"
        seqs = self._seqs.setdefault(name, itertools.count(1))
        site = self._sites[key] = _Site(name, op, seqs, overlapped=overlapped)
        return site

    def forget_group(self, group: Any) -> None:
        """Read `group`'s name again at its next op (its label changed). Ops already counted
        keep the old name; the new name's sequence numbers start at 1 on every member."""
        with self._lock:
            for key in [k for k in self._sites if k[0] == id(group)]:
                del self._sites[key]

    # -- the hot path ---------------------------------------------------------------------
    def begin(
        self,
        op: str,
        group: Any,
        tensors: Any,
        peer: int | None,
        *,
        blocking: bool,
        scale_bytes: int = 1,
        overlapped: bool = False,
    ) -> _Pending:
        """Record the start of one op; `scale_bytes` multiplies the tensors' size (gathers);
        `overlapped`: see `_Site` (the first call for a (group, op) decides)."""
        now = self._clock()
        key = (id(group), op) if peer is None else (id(group), op, peer)
        site = self._sites.get(key)
        if site is None:
            site = self._site(key, group, op, peer, overlapped)
        if type(tensors) is torch.Tensor:  # the common case, inline
            nbytes, dtype_b, device = tensors.nbytes, _dtype_bytes(tensors.dtype), -1
            if tensors.is_cuda:
                device = tensors.get_device()
        else:
            nbytes, dtype_b, device = _size(tensors)
        if scale_bytes != 1:
            nbytes *= scale_bytes
        seq, index, step = next(site.seqs), next(self._indices), self.step
        pending = _Pending(index, site, seq, nbytes, now, step)
        if device >= 0:  # timed on the device (see finish)
            pending.cuda_start, pending.device = stream_event(device), device
        page = self._page
        if page is not None and site.overlapped:  # onto the page later, off this thread
            self._later.append((pending, dtype_b))
        elif page is not None:
            page.begin_event(
                index, seq, step, nbytes, now + self._wall, site.group_b, site.op_b, dtype_b,
                blocking, now,
            )  # fmt: skip
        return pending

    def finish(self, pending: _Pending, *, sync: bool) -> None:
        """Record completion now (sync op returned, or an async op's future fired or was
        waited). On CUDA the end is an event on the current stream, which is ordered after the
        op's kernels there: a future's callback runs on such a stream, and a wait makes the
        current stream wait for the op (its CPU-side completion is only the enqueue)."""
        try:
            now = self._clock()
            if pending.cuda_start is not None:
                if sync:  # its device time, not this thread's, is the wait
                    pending.exposed_from = pending.cuda_start
                with self._lock:
                    self._cuda_pending.append((pending, stream_event(pending.device)))
                    self._on_device[pending.step] += 1
            else:
                self._complete(pending, now - pending.start, now)
                if sync:
                    self.blocked_s += now - pending.start
            if sync:
                page = self._page
                if page is not None:
                    site = pending.site
                    page.mark_collective(
                        site.group_b, pending.seq, site.op_b, False, now, now + self._wall
                    )
        except Exception as exc:  # fail-open: never raise into training or a comm thread
            self._on_error(exc)

    def _complete(
        self,
        pending: _Pending,
        duration: float,
        end: float,
        *,
        from_device: bool = False,
        exposed: float = 0.0,
    ) -> None:
        """Count a completed op in the current step's aggregates (`from_device`: a CUDA op
        read from its events, in those of the step that launched it while they are open;
        `exposed`: its device time that a stream waited for)."""
        site, nbytes, seq = pending.site, pending.nbytes, pending.seq
        with self._lock:
            window = site.baselines.get(nbytes)
            if window is None:
                window = site.baselines[nbytes] = collections.deque(maxlen=_BASELINE_WINDOW)
            window.append(duration)
            wait = duration - min(window)
            if from_device:
                aggs = self._open.get(pending.step, self._aggs)
                left = self._on_device[pending.step] - 1
                if left > 0:
                    self._on_device[pending.step] = left
                else:
                    self._on_device.pop(pending.step, None)
            else:
                aggs = self._aggs
            agg = aggs.get(site)
            if agg is None:
                agg = aggs[site] = _Agg()
            agg.count += 1
            agg.nbytes += nbytes
            agg.total_s += duration
            if duration > agg.max_s:
                agg.max_s = duration
            if wait > 0.0:
                agg.wait_s += wait
            if seq > agg.last_seq:
                agg.last_seq, agg.last_s = seq, duration
            agg.exposed_s += exposed
            self.collective_s += duration
        pending.end_wall = end + self._wall
        page = self._page
        if page is not None:
            page.finish_event(pending.index, pending.end_wall)

    def enter_wait(self, pending: _Pending) -> None:
        """The training thread blocks in the wait of an asynchronous op launched earlier (a
        Work's wait, a functional collective's wait_tensor): the progress page says it is in
        that collective, as it does during a synchronous one, so a hang names the rank it waits
        for. Other threads' waits are not the rank's position."""
        self._mark_wait(pending, True)

    def leave_wait(self, pending: _Pending) -> None:
        self._mark_wait(pending, False)

    def _mark_wait(self, pending: _Pending, within: bool) -> None:
        page = self._page
        if page is None or threading.get_ident() != self.training_thread:
            return
        try:
            now, site = self._clock(), pending.site
            wall = now + self._wall
            page.mark_collective(site.group_b, pending.seq, site.op_b, within, now, wall)
        except Exception as exc:  # fail-open
            self._on_error(exc)

    def wait_blocked(self, seconds: float, pending: _Pending | None = None) -> None:
        """The training thread waited `seconds` on the host (for `pending`, where known). A
        CUDA op's wait is its device's (`begin_device_wait`), not the host's."""
        if threading.get_ident() == self.training_thread and (
            pending is None or pending.cuda_start is None
        ):
            self.blocked_s += seconds

    def begin_device_wait(self, pending: _Pending) -> None:
        """The training thread is about to wait for asynchronous CUDA op `pending`: the current
        stream waits for it from here, so the op's device time past this point is exposed."""
        if (
            pending.cuda_start is None
            or pending.resolved
            or pending.exposed_from is not None
            or threading.get_ident() != self.training_thread
        ):
            return
        try:
            pending.exposed_from = stream_event(pending.device)
        except Exception as exc:  # fail-open
            self._on_error(exc)

    def now(self) -> float:
        """The recorder's clock (monotonic seconds unless a test gave another)."""
        return self._clock()

    def blocked_since(self, start: float) -> None:
        """The training thread was inside a communication call from `start` (this recorder's
        clock) until now: an asynchronous op's launch (gloo's p2p sends write their socket
        there and posting a receive notifies the peer; on a loaded host the thread also loses
        its CPU there) or a whole batch of p2p ops. Blocked time, never compute."""
        self.wait_blocked(self._clock() - start)

    def publish(self) -> None:
        """Put the overlapped ops launched since the last call (DDP's gradient buckets) on
        the progress page, with their ends where known. Launched inside backward, where every
        page write costs the training thread tens of microseconds, they are written here by the
        session's flusher, each interval and at the end (module docstring). Any thread but
        one at a time; fail-open."""
        page = self._page
        if page is None or not self._later:
            return
        try:
            with self._publish_lock:
                later, taken = self._later, []
                while later:  # the training thread only appends
                    taken.append(later.popleft())
                events = [_later_event(p, dtype_b, self._wall) for p, dtype_b in taken]
                page.publish_events(events)
                for (p, _), event in zip(taken, events, strict=True):
                    if p.end_wall and not event.end_wall:  # it ended while being written
                        page.finish_event(p.index, p.end_wall)
        except Exception as exc:  # fail-open
            self._on_error(exc)

    # -- step boundary --------------------------------------------------------------------
    def swap(self) -> tuple[StepAggregates, float, float]:
        """This step's aggregates (for `aggregate_records`), exposed blocked time and total
        collective time; starts the next step's. While ops of this step still run on a CUDA
        device, its aggregates stay open to them until `release(step)`."""
        self.resolve_cuda()
        with self._lock:
            aggs, self._aggs = self._aggs, {}
            blocked, self.blocked_s = self.blocked_s, 0.0
            total, self.collective_s = self.collective_s, 0.0
            if self._on_device.get(self.step):
                self._open[self.step] = aggs
        return aggs, blocked, total

    def release(self, step: int, *, force: bool = False) -> bool:
        """Close `step`'s aggregates once none of its ops is still running on a CUDA device, as
        of the last `resolve_cuda` (`force`: now, later completions count in the current
        step); False: not yet. Called before the step's records are built from them."""
        with self._lock:
            if step not in self._open:
                return True
            if not force and self._on_device.get(step):
                return False
            del self._open[step]
            return True

    def resolve_cuda(self) -> None:
        """Turn CUDA event pairs that have completed into durations, in the aggregates of the
        step that launched each op while they are open; never waits for the others. Any
        thread (the session's flusher does it each interval, so that a ring dumped during a
        hang shows which ops ended on the device)."""
        if not self._cuda_pending:
            return
        with self._lock:
            pending, self._cuda_pending = self._cuda_pending, []
        keep = []
        for item, end_event in pending:
            seconds = device_elapsed(item.cuda_start, end_event, item.device)
            if seconds is None:
                keep.append((item, end_event))
                continue
            item.resolved = True
            # Read after the end completed: a wait begun later comes after the op's end.
            since = item.exposed_from
            exposed = 0.0
            if since is item.cuda_start:
                exposed = seconds
            elif since is not None:  # a wait: nothing exposed if its stream got there later
                exposed = device_elapsed(since, end_event, item.device) or 0.0
            self._complete(item, seconds, item.start + seconds, from_device=True, exposed=exposed)
        with self._lock:
            self._cuda_pending[:0] = keep  # in launch order, before ops added meanwhile


StepAggregates = dict[_Site, _Agg]


def _later_event(pending: _Pending, dtype_b: bytes, wall: float) -> progress.LaterEvent:
    """`pending` as `CollectiveRecorder.publish` puts it on the page (`wall`: the recorder's
    wall-clock offset)."""
    p = pending
    return progress.LaterEvent(
        p.index, p.seq, p.step, p.nbytes, p.start + wall, p.start, p.end_wall, p.site.group_b,
        p.site.op_b, dtype_b,
    )  # fmt: skip


def exposed_s(aggs: StepAggregates) -> float:
    """A step's CUDA ops' device time that a stream waited for (see the module docstring)."""
    return sum(a.exposed_s for a in aggs.values())


def device_elapsed(start: Any, end: Any, device: int) -> float | None:
    """Seconds from CUDA event `start` to `end` on `device` (0 when `end` came first), or None
    while either has not completed. Never blocks."""
    with _device_guard(device):  # never a context on another device
        if not (end.query() and start.query()):
            return None
        return max(0.0, float(start.elapsed_time(end)) / 1000.0)


def aggregate_records(
    aggs: StepAggregates, *, job: str, rank: int, step: int
) -> list[schema.CollectiveAggregate]:
    """One step's per-(group, op) aggregates as records (built off the training thread)."""
    return [
        schema.CollectiveAggregate(
            job_id=job,
            rank=rank,
            step=step,
            group=site.group,
            op=site.op,
            count=a.count,
            bytes=a.nbytes,
            total_device_s=a.total_s,
            max_device_s=a.max_s,
            total_wait_s=a.wait_s,
            last_seq=a.last_seq,
            last_device_s=a.last_s,
            overlapped=site.overlapped,
        )
        for site, a in aggs.items()
    ]


def _describe_group(group: Any) -> str:
    # `<label>:<group_name>` (groups.py): the label says which parallel dimension ("tp", a
    # DeviceMesh's "dp", one given by `label_group`), the id is unique among groups that share
    # a label (each TP group of a job is "tp"); the same on every member rank.
    return groups.describe(group)


_DTYPE_BYTES: dict[torch.dtype, bytes] = {}  # torch.float32 -> b"float32", as the page stores it


def _dtype_bytes(dtype: torch.dtype) -> bytes:
    name = _DTYPE_BYTES.get(dtype)
    if name is None:
        name = _DTYPE_BYTES[dtype] = progress.encode_dtype(str(dtype).removeprefix("torch."))
    return name


def _size(tensors: Any) -> tuple[int, bytes, int]:
    """(bytes, encoded dtype, CUDA device index or -1) of a tensor or a list of tensors (None:
    a barrier)."""
    if tensors is None:
        return 0, b"", -1
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    total, dtype, device = 0, b"", -1
    for t in tensors:
        if isinstance(t, torch.Tensor):
            total += t.nbytes
            dtype, device = _dtype_bytes(t.dtype), t.get_device() if t.is_cuda else -1
    return total, dtype, device


def _device_guard(device: int) -> Any:
    return torch.cuda.device(device)


def stream_event(device: int) -> Any:
    """A timing event recorded on `device`'s current stream (in a CUDA future's callback, a
    stream made to wait for the op's kernels)."""
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event
