"""Times every torch.distributed collective and point-to-point op a training process issues.

`install()` wraps the public functions of `torch.distributed` (the names FSDP2, tensor
parallelism and user code call through `dist.<name>`), and `Work.wait` to measure how long the
training thread is blocked on asynchronous work. DDP's gradient all-reduce runs in C++ and is
reached through a communication hook (`ddp_comm_hook`) that records it and calls the process group.

Per event: process group, per-group sequence number, op, bytes, dtype, enqueue/start/end. Events
go to the progress page's ring buffer; per-(group, op) aggregates are kept for the step record.
Asynchronous ops are timed at completion through their Work's future (or their wait). On CUDA
every op is timed with events, read without blocking (`resolve_cuda`): one recorded on the
issuing stream at launch, one on the stream that is current where completion is observed. A
CUDA future completes, and calls back, as soon as its op is enqueued, but on a stream made to
wait for the op's kernels, and a wait makes the current stream wait for them, so that second
event marks the end on the device. A step's aggregates stay open to its ops still on the device
until `release`. On CPU the monotonic clock is used.

Every hook is fail-open: an internal error is counted and the original call proceeds untouched.
This module must not do I/O beyond the progress page, and never blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from vigil import schema
from vigil.agent import functional, progress

log = logging.getLogger(__name__)

# name -> (tensor argument, how to size it, group argument). "output"/"input" name the argument
# whose bytes count as the message size (NCCL-tests convention: all-gather counts its output,
# reduce-scatter its input).
_SPECS: dict[str, tuple[str | None, str]] = {
    "all_reduce": ("tensor", "group"),
    "all_reduce_coalesced": ("tensors", "group"),
    "broadcast": ("tensor", "group"),
    "reduce": ("tensor", "group"),
    "all_gather": ("tensor_list", "group"),
    "all_gather_single": ("output_tensor", "group"),
    "all_gather_into_tensor": ("output_tensor", "group"),
    "reduce_scatter": ("input_list", "group"),
    "reduce_scatter_single": ("input", "group"),
    "reduce_scatter_tensor": ("input", "group"),
    "all_to_all": ("input_tensor_list", "group"),
    "all_to_all_single": ("input", "group"),
    "gather": ("tensor", "group"),
    "scatter": ("tensor", "group"),
    "barrier": (None, "group"),
    "send": ("tensor", "group"),
    "recv": ("tensor", "group"),
    "isend": ("tensor", "group"),
    "irecv": ("tensor", "group"),
}
_P2P = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}
_P2P_OP_CHECKED = frozenset({"isend", "irecv"})  # what P2POp accepts as its op
_ALWAYS_ASYNC = {"isend", "irecv"}
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
        self.blocked_s = 0.0  # training-thread time blocked in sync ops and Work.wait this step
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
            pending.cuda_start, pending.device = _cuda_event(device), device
        page = self._page
        if page is not None:
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
                with self._lock:
                    self._cuda_pending.append((pending, _cuda_event(pending.device)))
                    self._on_device[pending.step] += 1
            else:
                self._complete(pending, now - pending.start, now)
            if sync:
                self.blocked_s += now - pending.start
                page = self._page
                if page is not None:
                    site = pending.site
                    page.mark_collective(
                        site.group_b, pending.seq, site.op_b, False, now, now + self._wall
                    )
        except Exception as exc:  # fail-open: never raise into training or a comm thread
            self._on_error(exc)

    def _complete(
        self, pending: _Pending, duration: float, end: float, *, from_device: bool = False
    ) -> None:
        """Count a completed op in the current step's aggregates (`from_device`: a CUDA op
        read from its events, in those of the step that launched it while they are open)."""
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
            self.collective_s += duration
        page = self._page
        if page is not None:
            page.finish_event(pending.index, end + self._wall)

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

    def wait_blocked(self, seconds: float) -> None:
        if threading.get_ident() == self.training_thread:
            self.blocked_s += seconds

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
            with _device_guard(item.device):  # never a context on another device
                seconds = (
                    item.cuda_start.elapsed_time(end_event) / 1000.0 if end_event.query() else -1.0
                )
            if seconds >= 0.0:
                self._complete(item, seconds, item.start + seconds, from_device=True)
            else:
                keep.append((item, end_event))
        with self._lock:
            self._cuda_pending[:0] = keep  # in launch order, before ops added meanwhile


StepAggregates = dict[_Site, _Agg]


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
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    # The user's description ("tp", "dp_shard") plus the group's id, unique among groups that
    # share a description (each TP group of a job is "tp"); the same on every member rank.
    desc = getattr(group, "group_desc", "")
    ident = getattr(group, "group_name", "?")
    if desc and desc not in ("undefined", "default_pg"):
        return f"{desc}:{ident}"[:32]
    return f"pg:{ident}"[:32]


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


def _cuda_event(device: int) -> Any:
    """A timing event recorded on `device`'s current stream (in a CUDA future's callback, a
    stream made to wait for the op's kernels)."""
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


# -- installing the wrappers ----------------------------------------------------------------
_state = threading.local()  # .depth: inside a wrapped call (inner calls are not recorded again)
_active: CollectiveRecorder | None = None
_originals: dict[str, Any] = {}


def active() -> CollectiveRecorder | None:
    """The recorder wrapped calls report to, or None when not installed / inside a wrapped call."""
    return None if getattr(_state, "depth", False) else _active


def _position(fn: Callable[..., Any], name: str | None) -> int:
    if name is None:
        return -1
    params = list(inspect.signature(fn).parameters)
    return params.index(name) if name in params else -1


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str | None) -> Any:
    if name is None:
        return None
    if 0 <= pos < len(args):
        return args[pos]
    return kwargs.get(name)


def _wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    tensor_name, group_name = _SPECS[op]
    peer_name = _P2P.get(op)
    t_pos, g_pos = _position(fn, tensor_name), _position(fn, group_name)
    p_pos, a_pos = _position(fn, peer_name), _position(fn, "async_op")
    # P2P ops may name the peer by its rank in the group (`group_dst`/`group_src`), as
    # batch_isend_irecv (pipelining) does: the pair's name needs the global rank.
    group_peer_name = f"group_{peer_name}" if peer_name is not None else None
    gp_pos = _position(fn, group_peer_name)

    always_async = op in _ALWAYS_ASYNC

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None or getattr(_state, "depth", False):
            return fn(*args, **kwargs)
        try:
            group = _arg(args, kwargs, g_pos, group_name)
            peer = _arg(args, kwargs, p_pos, peer_name) if peer_name is not None else None
            if peer is None and group_peer_name is not None:
                group_peer = _arg(args, kwargs, gp_pos, group_peer_name)
                if group_peer is not None:
                    peer = _global_rank(group, int(group_peer))
            is_async = always_async or bool(_arg(args, kwargs, a_pos, "async_op"))
            pending = recorder.begin(
                op,
                group,
                _arg(args, kwargs, t_pos, tensor_name),
                int(peer) if peer is not None else None,
                blocking=not is_async,
            )
        except Exception as exc:
            recorder._on_error(exc)
            return fn(*args, **kwargs)
        _state.depth = True
        try:
            result = fn(*args, **kwargs)
        finally:
            _state.depth = False
        if is_async and result is not None:
            _on_completion(recorder, pending, result)
        else:
            recorder.finish(pending, sync=True)
        return result

    wrapper.__vigil_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _global_rank(group: Any, group_rank: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def _on_completion(recorder: CollectiveRecorder, pending: _Pending, work: Any) -> None:
    # Remembered while in flight for Work.wait, which marks the rank as in this collective
    # while it blocks there (no reference to the Work: its buffers must not outlive it).
    key = id(work)
    if len(_waitable) >= _MAX_WAITABLE:  # a safety net: entries leave when their op completes
        _waitable.pop(next(iter(_waitable)))

    def done(_f: Any) -> None:
        _waitable.pop(key, None)
        recorder.finish(pending, sync=False)

    _waitable[key] = (recorder, pending, False)  # before: a done future calls back at once
    try:
        work.get_future().add_done_callback(done)
    except Exception:  # a Work type without futures: completion is observed at wait()
        _waitable[key] = (recorder, pending, True)


# In-flight asynchronous ops by id(Work): (recorder, op, whether its wait() completes it).
# Bounded, oldest forgotten first.
_MAX_WAITABLE = 4096
_waitable: dict[int, tuple[CollectiveRecorder, _Pending, bool]] = {}


def _wrap_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None or getattr(_state, "depth", False):
            # Inside a wrapped synchronous collective (it waits on its own Work): that time is
            # already the collective's; counting it here too would double the exposed wait.
            return original(self, *args, **kwargs)
        waited = _waitable.get(id(self))
        if waited is not None:
            waited[0].enter_wait(waited[1])
        start = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            try:
                recorder.wait_blocked(time.monotonic() - start)
                if waited is not None:
                    owner, pending, finish_here = waited
                    owner.leave_wait(pending)
                    if finish_here:
                        _waitable.pop(id(self), None)
                        owner.finish(pending, sync=False)
            except Exception as exc:
                recorder._on_error(exc)

    return wait


def install(recorder: CollectiveRecorder) -> None:
    """Route torch.distributed's collectives through `recorder` (idempotent)."""
    global _active
    _active = recorder
    if _originals:
        return
    for op in _SPECS:
        fn = getattr(dist, op, None)
        if fn is None or hasattr(fn, "__vigil_wrapped__"):
            continue
        _originals[op] = fn
        wrapped = _wrap(op, fn)
        setattr(dist, op, wrapped)
        if op in _P2P_OP_CHECKED and getattr(_c10d, op, None) is fn:
            # `dist.P2POp(dist.isend, ...)` (batch_isend_irecv, pipelining) checks its op
            # against the c10d module's own name: it must be the wrapper there too.
            setattr(_c10d, op, wrapped)
    work_type = getattr(dist, "Work", None)
    if work_type is not None:
        _originals["Work.wait"] = work_type.wait
        work_type.wait = _wrap_wait(work_type.wait)
    functional.install()


def uninstall() -> None:
    """Restore the original functions; wrapped calls in flight finish normally."""
    global _active
    _active = None
    functional.uninstall()
    for name, fn in list(_originals.items()):
        if name == "Work.wait":
            dist.Work.wait = fn  # type: ignore[method-assign]
        else:
            setattr(dist, name, fn)
            if name in _P2P_OP_CHECKED:
                setattr(_c10d, name, fn)
    _originals.clear()
    _waitable.clear()


# DDP's gradient-bucket all-reduces are their own op: their aggregate is `overlapped` (see
# `_Site`) and must not mix with the job's own all-reduces on the same group.
DDP_ALL_REDUCE = "ddp_all_reduce"


def ddp_comm_hook(process_group: Any, bucket: Any) -> Any:
    """DDP's default all-reduce (average over the group), timed: one future callback both
    records completion and hands DDP the reduced bucket, so a bucket costs the comm thread one
    Python call, as torch's own default hook does. The process group is called directly (as
    torch's default hook does), not through `dist.all_reduce`'s Python checks; NCCL averages in
    its kernel, other backends sum a bucket divided first."""
    tensor = bucket.buffer()
    group: Any = process_group if process_group is not None else dist.group.WORLD
    options = _divide_for_average(group, tensor)
    recorder, pending = _active, None
    if recorder is not None:
        try:
            pending = recorder.begin(
                DDP_ALL_REDUCE, group, tensor, None, blocking=False, overlapped=True
            )
        except Exception as exc:  # fail-open: the all-reduce goes on untimed
            recorder._on_error(exc)
    fut = _start_all_reduce(group, tensor, options)
    if recorder is None or pending is None:
        return fut.then(_reduced)
    timed_by, op = recorder, pending

    def done(f: Any) -> Any:
        timed_by.finish(op, sync=False)  # fail-open: finish never raises
        return f.value()[0]

    return fut.then(done)


# What DDP does to a bucket with or without a hook, in functions of their own so that a sampling
# profile tells this work from the SDK's bookkeeping (bench/sdk_overhead.py).
def _divide_for_average(group: Any, tensor: torch.Tensor) -> Any:
    """The options that average over `group`, dividing `tensor` first where they only sum."""
    options = _average_options(group)
    if options.reduceOp != dist.ReduceOp.AVG:
        tensor.div_(group.size())
    return options


def _start_all_reduce(group: Any, tensor: torch.Tensor, options: Any) -> Any:
    return group.allreduce([tensor], options).get_future()


DDP_BUCKET_WORK = (_divide_for_average.__name__, _start_all_reduce.__name__)


# id(group) -> (group, options); the group is held, so its id stays its own.
_AVERAGING: dict[int, tuple[Any, Any]] = {}


def _average_options(group: Any) -> Any:
    """All-reduce options that average over `group`: AVG where the backend has it (NCCL),
    else SUM (the caller divides first)."""
    entry = _AVERAGING.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    options = dist.AllreduceOptions()
    try:
        nccl = dist.get_backend(group) == dist.Backend.NCCL
    except (RuntimeError, ValueError):  # not a registered group: take the portable path
        nccl = False
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM)
    _AVERAGING[id(group)] = (group, options)
    return options


def _reduced(fut: Any) -> Any:
    return fut.value()[0]


# DDP checks the hook's annotations at registration; with postponed evaluation they are strings.
ddp_comm_hook.__annotations__ = {
    "process_group": object,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}
