"""Times torch.distributed's functional collectives (the path DTensor tensor parallelism takes).

DTensor redistributions call `torch.distributed._functional_collectives` (`all_reduce`,
`all_gather_single`, `reduce_scatter_single`, ...), which launch the op and return an
AsyncCollectiveTensor that waits (`wait_tensor`) on first use. Each wrapped call is recorded at
launch by the active recorder (`patching.active()`) and completed when its `wait_tensor` runs
(the time the training thread blocks there is exposed wait). Collectives inside autograd's
backward formulas run as C++ ops and are not seen here.

Must not import `vigil.agent.patching` at module level (it imports this module); no I/O.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# op -> (group argument, does the message size scale with the group size)
_OPS: dict[str, tuple[str, bool]] = {
    "all_reduce": ("group", False),
    "broadcast": ("group", False),
    "all_gather_single": ("group", True),
    "all_gather_tensor": ("group", True),
    "reduce_scatter_single": ("group", False),
    "reduce_scatter_tensor": ("group", False),
    "all_to_all_single": ("group", False),
}
# Launched but never waited results (discarded tensors) are forgotten past this many.
_MAX_PENDING = 10_000
_originals: dict[str, Any] = {}
_pending: dict[int, tuple[Any, Any]] = {}


def _module() -> Any:
    try:
        from torch.distributed import _functional_collectives
    except ImportError:  # older torch without functional collectives
        return None
    return _functional_collectives


def _process_group(module: Any, group: Any) -> Any:
    name = module._resolve_group_name(group)
    return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[attr-defined]


def _key(tensor: torch.Tensor) -> int:
    # The storage, not the tensor object: DTensor often waits on a view of the launched output.
    return int(tensor.untyped_storage().data_ptr())


def _wrap(module: Any, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    group_arg, gathers = _OPS[op]
    params = list(inspect.signature(fn).parameters)
    g_pos = params.index(group_arg)
    async_type = module.AsyncCollectiveTensor

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from vigil.agent import patching

        recorder = patching.active()
        if recorder is None:
            return fn(*args, **kwargs)
        try:
            group = args[g_pos] if g_pos < len(args) else kwargs[group_arg]
            pg = _process_group(module, group)
            pending = recorder.begin(
                op,
                pg,
                args[0] if args else kwargs.get("self"),
                None,
                blocking=False,
                scale_bytes=pg.size() if gathers else 1,
            )
        except Exception as exc:
            recorder._on_error(exc)
            return fn(*args, **kwargs)
        patching._state.depth = True
        try:
            result = fn(*args, **kwargs)
        finally:
            patching._state.depth = False
        if isinstance(result, async_type):
            if len(_pending) >= _MAX_PENDING:
                _pending.pop(next(iter(_pending)))
            _pending[_key(result.elem)] = (recorder, pending)
        else:  # already waited (tracing, or a synchronous backend)
            recorder.finish(pending, sync=True)
        return result

    wrapper.__vigil_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wait_tensor(tensor: torch.Tensor) -> Any:
        entry = _pending.pop(_key(tensor), None)
        if entry is None:
            return fn(tensor)
        recorder, pending = entry
        recorder.enter_wait(pending)
        recorder.begin_device_wait(pending)  # on CUDA the stream waits from here
        start = time.monotonic()
        try:
            return fn(tensor)
        finally:
            recorder.wait_blocked(time.monotonic() - start, pending)
            recorder.leave_wait(pending)
            recorder.finish(pending, sync=False)

    return wait_tensor


def install() -> None:
    module = _module()
    if module is None or _originals:
        return
    for op in _OPS:
        fn = getattr(module, op, None)
        if fn is not None and not hasattr(fn, "__vigil_wrapped__"):
            _originals[op] = fn
            setattr(module, op, _wrap(module, op, fn))
    _originals["wait_tensor"] = module.wait_tensor
    module.wait_tensor = _wrap_wait(module.wait_tensor)


def uninstall() -> None:
    module = _module()
    if module is None:
        return
    for name, fn in list(_originals.items()):
        setattr(module, name, fn)
    _originals.clear()
    _pending.clear()
