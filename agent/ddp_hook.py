"""DDP's gradient all-reduce, timed through a communication hook.

DDP's reducer all-reduces gradient buckets in C++, past `torch.distributed`'s Python functions;
`watch(ddp_model)` registers `ddp_comm_hook`, which records each bucket with the active
recorder (op `ddp_all_reduce`, `overlapped`: DDP waits for the buckets inside C++, where the
SDK cannot see) and runs the default all-reduce on the process group directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vigil.agent import patching

# DDP's gradient-bucket all-reduces are their own op: their aggregate is `overlapped` (see
# `_Site`) and must not mix with the job's own all-reduces on the same group.
DDP_ALL_REDUCE = "ddp_all_reduce"


def ddp_comm_hook(process_group: Any, bucket: Any) -> Any:
    """DDP's default all-reduce (average over the group), timed: one future callback both
    records completion and hands DDP the reduced bucket, so a bucket costs the comm thread one
    Python call, as torch's own default hook does. The process group is called directly (as
    torch's default hook does), not through `dist.all_reduce`'s Python checks. NCCL averages in
    its kernel; where the backend only sums, the reduced bucket is divided in that same
    callback, on the comm thread, while the training thread goes on with backward (a float16
    bucket is divided first, as torch's default hook does, so that its sum cannot overflow)."""
    tensor = bucket.buffer()
    group: Any = process_group if process_group is not None else dist.group.WORLD
    options, divisor = _divide_for_average(group, tensor)
    recorder, pending = patching.active_recorder(), None
    if recorder is not None:
        try:
            pending = recorder.begin(
                DDP_ALL_REDUCE, group, tensor, None, blocking=False, overlapped=True
            )
        except Exception as exc:  # fail-open: the all-reduce goes on untimed
            recorder._on_error(exc)
    fut = _start_all_reduce(group, tensor, options)
    timed_by, op = recorder, pending

    def done(f: Any) -> Any:
        if op is not None and timed_by is not None:
            timed_by.finish(op, sync=False)  # fail-open: finish never raises
        reduced: torch.Tensor = f.value()[0]
        return reduced.div_(divisor) if divisor > 1 else reduced

    return fut.then(done)


# What DDP does to a bucket with or without a hook, in functions of their own so that a sampling
# profile tells this work from the SDK's bookkeeping (bench/sdk_overhead.py).
def _divide_for_average(group: Any, tensor: torch.Tensor) -> tuple[Any, int]:
    """The options that average over `group`, and what the reduced bucket must still be
    divided by: 1 where the backend averages (NCCL) or where `tensor` (float16, whose sum could
    overflow) is divided here first, else the group's size."""
    options = _average_options(group)
    if options.reduceOp == dist.ReduceOp.AVG:
        return options, 1
    if tensor.dtype == torch.float16:
        tensor.div_(group.size())
        return options, 1
    return options, group.size()


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


# DDP checks the hook's annotations at registration; with postponed evaluation they are strings.
ddp_comm_hook.__annotations__ = {
    "process_group": object,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}
