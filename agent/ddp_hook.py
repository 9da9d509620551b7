"""DDP's gradient all-reduce, timed through a communication hook.

DDP's reducer all-reduces gradient buckets in C++, past `torch.distributed`'s Python functions;
`watch(ddp_model)` registers `ddp_comm_hook` with the `HookState` of the model's process group,
which records each bucket with the active recorder (op `ddp_all_reduce`, `overlapped`: DDP waits
for the buckets inside C++, where the SDK cannot see) and runs the default all-reduce on the
process group directly.

The hook runs on the training thread once per bucket, between backward's kernels, whose data
has evicted the SDK's from the CPU's caches by then: there every Python call and every call into
torch's bindings costs tens of microseconds, not one or two. So whatever a bucket's all-reduce
needs that does not change from bucket to bucket (the group, its options, the divisor) is worked
out once, in the state DDP hands back with every bucket (bench/sdk_overhead.py measures this
cost in place).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vigil.agent import patching

# DDP's gradient-bucket all-reduces are their own op: their aggregate is `overlapped` (see
# `_Site`) and must not mix with the job's own all-reduces on the same group.
DDP_ALL_REDUCE = "ddp_all_reduce"


class HookState:
    """What `ddp_comm_hook` needs of a process group, worked out once (`state_for`): the
    group, all-reduce options that average over it (AVG where the backend has it, NCCL; else
    SUM) and what a reduced bucket must still be divided by (1 where the backend averages,
    else the group's size)."""

    __slots__ = ("divisor", "group", "options")

    def __init__(self, group: Any) -> None:
        self.group = group
        self.options = _average_options(group)
        self.divisor = 1 if self.options.reduceOp == dist.ReduceOp.AVG else group.size()


def ddp_comm_hook(state: HookState | Any, bucket: Any) -> Any:
    """DDP's default all-reduce (average over the group), timed: one future callback both
    records completion and hands DDP the reduced bucket, so a bucket costs the comm thread one
    Python call, as torch's own default hook does. The process group is called directly (as
    torch's default hook does), not through `dist.all_reduce`'s Python checks. NCCL averages in
    its kernel; where the backend only sums, the reduced bucket is divided in that same
    callback, on the comm thread, while the training thread goes on with backward (a float16
    bucket is divided first, as torch's default hook does, so that its sum cannot overflow).

    `state` is the `HookState` that `watch` registers, or a process group (None: the default
    group) where a user registers the hook themselves."""
    if type(state) is not HookState:
        state = state_for(state)
    tensor = bucket.buffer()
    divisor = state.divisor
    if divisor > 1 and tensor.dtype is torch.float16:
        _divide_first(tensor, divisor)
        divisor = 1
    recorder, pending = patching.active_recorder(), None
    if recorder is not None:
        try:
            pending = recorder.begin(
                DDP_ALL_REDUCE, state.group, tensor, None, blocking=False, overlapped=True
            )
        except Exception as exc:  # fail-open: the all-reduce goes on untimed
            recorder._on_error(exc)
    fut = _start_all_reduce(state.group, tensor, state.options)

    def done(f: Any) -> Any:
        if pending is not None and recorder is not None:
            recorder.finish(pending, sync=False)  # fail-open: finish never raises
        reduced: torch.Tensor = f.value()[0]
        return reduced.div_(divisor) if divisor > 1 else reduced

    return fut.then(done)


# What DDP does to a bucket with or without a hook, in functions of their own so that a sampling
# profile tells this work from the SDK's bookkeeping (bench/sdk_overhead.py).
def _divide_first(tensor: torch.Tensor, divisor: int) -> None:
    tensor.div_(divisor)


def _start_all_reduce(group: Any, tensor: torch.Tensor, options: Any) -> Any:
    return group.allreduce([tensor], options).get_future()


DDP_BUCKET_WORK = (_divide_first.__name__, _start_all_reduce.__name__)


# id(group) -> (group, state). The group is held for the process's life, so that its id stays
# its own and a DDP model's teardown never destroys it: gloo's destructor joins its threads,
# which may still be freeing work that holds Python objects and so wait for the GIL that the
# thread freeing the model holds.
_STATES: dict[int, tuple[Any, HookState]] = {}


def state_for(process_group: Any) -> HookState:
    """The `HookState` of `process_group` (None: the default group as of now), made once."""
    group = process_group if process_group is not None else dist.group.WORLD
    entry = _STATES.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    state = HookState(group)
    _STATES[id(group)] = (group, state)
    return state


def registered(model: Any) -> bool:
    """Whether `ddp_comm_hook` is already `model`'s comm hook (a DDP model watched by an earlier
    session in this process: DDP takes one hook for its lifetime, and that one records with
    whichever recorder is active, so it times the new session's all-reduces too)."""
    hooks = getattr(model, "_comm_hooks", None) or ()
    return any(hook is ddp_comm_hook for hook, _ in hooks)


def _average_options(group: Any) -> Any:
    """All-reduce options that average over `group`: AVG where the backend has it (NCCL),
    else SUM (the caller divides)."""
    options = dist.AllreduceOptions()
    try:
        nccl = dist.get_backend(group) == dist.Backend.NCCL
    except (RuntimeError, ValueError):  # not a registered group: take the portable path
        nccl = False
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM)
    return options


# DDP checks the hook's annotations at registration; with postponed evaluation they are strings.
ddp_comm_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}
