"""Routes torch.distributed's collectives through the active `CollectiveRecorder`.

`install()` wraps the public functions of `torch.distributed` (the names FSDP2, tensor
parallelism and user code call through `dist.<name>`; `isend`/`irecv` in the c10d module too,
where `P2POp` checks them), `batch_isend_irecv` (its ops are recorded one by one through those),
`Work.wait` (how long the training thread is blocked on asynchronous work, and that it waits in
that collective) and the functional collectives (`functional.py`). Inner calls of a wrapped
call are not recorded again. The training thread's time inside a wrapped call counts as its
communication time (`CollectiveRecorder.blocked_s`, the step record's `comm_wait_s`): the
whole of a synchronous op, the launch of an asynchronous one (gloo's p2p sends write their
socket in it), a whole batch of p2p ops, and every wait. Every wrapper is
fail-open: an internal error is counted and the original call proceeds untouched.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from vigil.agent import functional
from vigil.agent.collectives import CollectiveRecorder, _Pending

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

_state = threading.local()  # .depth: inside a wrapped call (inner calls are not recorded again)
_active: CollectiveRecorder | None = None
_originals: dict[str, Any] = {}


def active_recorder() -> CollectiveRecorder | None:
    """The installed recorder, also inside a wrapped call (DDP's hook runs in C++'s)."""
    return _active


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
            if not getattr(_state, "batch", False):  # a batch counts its whole call
                recorder.blocked_since(pending.start)
            _on_completion(recorder, pending, result)
        else:
            recorder.finish(pending, sync=True)
        return result

    wrapper.__vigil_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`batch_isend_irecv`: its ops are recorded one by one (it calls the wrapped
    `isend`/`irecv`), and the whole call, checks and coalescing included, is the training
    thread's communication time (a pipeline stage issues one per microbatch)."""

    @functools.wraps(fn)
    def batch(*args: Any, **kwargs: Any) -> Any:
        recorder = _active
        if recorder is None or getattr(_state, "depth", False) or getattr(_state, "batch", False):
            return fn(*args, **kwargs)
        start = recorder.now()
        _state.batch = True
        try:
            return fn(*args, **kwargs)
        finally:
            _state.batch = False
            recorder.blocked_since(start)

    batch.__vigil_wrapped__ = fn  # type: ignore[attr-defined]
    return batch


def _global_rank(group: Any, group_rank: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def _on_completion(recorder: CollectiveRecorder, pending: _Pending, work: Any) -> None:
    # Remembered while in flight for Work.wait, which marks the rank as in this collective
    # while it blocks there (no reference to the Work: its buffers must not outlive it). A
    # CUDA op's future completes at enqueue: its entry stays until its wait, which times the
    # device's wait from there (`begin_device_wait`).
    key = id(work)
    if len(_waitable) >= _MAX_WAITABLE:  # a safety net: entries leave at completion or wait
        _waitable.pop(next(iter(_waitable)))

    def done(_f: Any) -> None:
        if pending.cuda_start is None:  # a CUDA op's entry stays for its wait (see _wrap_wait)
            _waitable.pop(key, None)
        recorder.finish(pending, sync=False)

    _waitable[key] = (recorder, pending, False)  # before: a done future calls back at once
    try:
        work.get_future().add_done_callback(done)
    except Exception:  # a Work type without futures: completion is observed at wait()
        _waitable[key] = (recorder, pending, True)


# Asynchronous ops in flight (on CUDA: not yet waited for) by id(Work): (recorder, op, whether
# its wait() completes it). Bounded, oldest forgotten first.
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
            waited[0].begin_device_wait(waited[1])  # on CUDA the stream waits from here
        start = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            try:
                recorder.wait_blocked(
                    time.monotonic() - start, waited[1] if waited is not None else None
                )
                if waited is not None:
                    owner, pending, finish_here = waited
                    owner.leave_wait(pending)
                    if finish_here or pending.cuda_start is not None:  # done with its entry
                        _waitable.pop(id(self), None)
                    if finish_here:
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
    batch = getattr(dist, "batch_isend_irecv", None)
    if batch is not None and not hasattr(batch, "__vigil_wrapped__"):
        _originals["batch_isend_irecv"] = batch
        dist.batch_isend_irecv = _wrap_batch(batch)
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
