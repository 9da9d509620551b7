"""Megatron-core: its process groups labelled by parallel dimension, its schedule timed per step.

    from megatron.core import parallel_state
    from vigil.integrations import megatron as vigil_megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, ...)
    vigil.agent.init(job="gpt-moe")
    vigil_megatron.label_groups()  # tp, pp, dp, cp, ep, dp_cp, tp_dp, embd, ... on every rank
    forward_backward = vigil_megatron.timed(get_forward_backward_func())
    for i in range(iters):
        with vigil.agent.step(i, tokens=global_batch * seq_len // dp_size):
            losses = forward_backward(forward_step_func=..., data_iterator=..., model=..., ...)
            optimizer.step()

`label_groups()` names every group this rank is in after `initialize_model_parallel` by the
Megatron group it is (its `group_desc`, the same on every member: TENSOR_MODEL_PARALLEL_GROUP
is `tp`, MODEL_PARALLEL_GROUP `mp`, DATA_PARALLEL_GROUP_WITH_CP `dp_cp`, the expert groups
`ep`, `ep_tp`, `ep_dp`, ...; the labels are the keys Megatron's own NCCL communicator config
uses), so findings say "the tp group of node-3 (ranks 4-7)". Groups are found through
parallel_state's public getters and, where present, its list of the groups it created.

`timed(func)` wraps the schedule `get_forward_backward_func()` returns: inside a step, each
call of the user's `forward_step_func` counts as forward time, the rest of the schedule
(backward, the loss function, pipeline send/receive, the gradient reduction of
`finalize_model_grads`) as backward time, and the whole call as a pipeline schedule's
(`span("pipeline")`: a stage's time outside it is its own); the collectives inside are recorded
by the SDK as usual. A forward-only call (evaluation) is not timed. Fail-open like every SDK
hook: the schedule's own errors propagate untouched, vigil's are counted.

On CPU (gloo), megatron-core 0.16.1's `initialize_model_parallel` runs and every group is
labelled (tests/integrations/test_megatron.py, 4 ranks, tp=2 x pp=2 and dp=2 x tp=2; only its
`use_sharp=True` path and `update_pg_timeout` call into CUDA), but no
schedule runs: each allocates a CUDA tensor before the first micro-batch
(`torch.zeros([], dtype=torch.int, device="cuda")`, megatron/core/pipeline_parallel/
schedules.py line 596 without pipelining, 983 interleaved, 2138 1F1B), and pipeline
send/receive allocates on `torch.cuda.current_device()` (p2p_communication.py). The real
schedule is timed on a GPU by bench/gpu/megatron_check.py (bench/gpu/run.sh).

This module imports megatron only when called, vigil only through `vigil.agent`; it never
calls torch.distributed collectives itself.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import vigil.agent

log = logging.getLogger(__name__)

# Megatron's group_desc -> vigil label. The labels follow megatron's communicator-config keys
# (get_nccl_options); gloo twins get `_gloo`.
DESC_LABELS: dict[str, str] = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "DATA_PARALLEL_GROUP": "dp",
    "DATA_PARALLEL_GROUP_GLOO": "dp_gloo",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "DATA_PARALLEL_GROUP_WITH_CP_AG": "dp_cp_ag",
    "DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp_gloo",
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp",
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "intra_dp_cp_gloo",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "MODEL_PARALLEL_GROUP": "mp",
    "EMBEDDING_GROUP": "embd",
    "POSITION_EMBEDDING_GROUP": "pos_embd",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_TENSOR_PARALLEL_GROUP": "ep_tp",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep_mp",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "EXPERT_DATA_PARALLEL_GROUP": "ep_dp",
    "EXPERT_DATA_PARALLEL_GROUP_GLOO": "ep_dp_gloo",
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
}
# Hierarchical groups: HIERARCHICAL_<desc>_L<n> (context parallel, expert data parallel) and
# HYBRID_DP_CP_GROUP_<size>.
_HIERARCHICAL = re.compile(r"HIERARCHICAL_(?P<desc>.+?)(?P<gloo>_GLOO)?_L(?P<level>\d+)")
_HYBRID = re.compile(r"HYBRID_DP_CP_GROUP_(?P<size>\d+)")

# parallel_state getter (and keyword arguments) -> label, for groups without a known
# group_desc (torch < 2.4 drops it). Order matters only there: the first label of a group wins.
GETTERS: tuple[tuple[str, dict[str, bool], str], ...] = (
    ("get_tensor_model_parallel_group", {}, "tp"),
    ("get_pipeline_model_parallel_group", {}, "pp"),
    ("get_data_parallel_group", {}, "dp"),
    ("get_data_parallel_group", {"with_context_parallel": True}, "dp_cp"),
    ("get_data_parallel_group_gloo", {}, "dp_gloo"),
    ("get_data_parallel_group_gloo", {"with_context_parallel": True}, "dp_cp_gloo"),
    ("get_context_parallel_group", {}, "cp"),
    ("get_model_parallel_group", {}, "mp"),
    ("get_embedding_group", {}, "embd"),
    ("get_position_embedding_group", {}, "pos_embd"),
    ("get_tensor_and_data_parallel_group", {}, "tp_dp"),
    ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}, "tp_dp_cp"),
    ("get_tensor_and_context_parallel_group", {}, "tp_cp"),
    ("get_expert_model_parallel_group", {}, "ep"),
    ("get_expert_tensor_parallel_group", {}, "ep_tp"),
    ("get_expert_tensor_and_model_parallel_group", {}, "tp_ep_mp"),
    ("get_expert_tensor_model_pipeline_parallel_group", {}, "tp_ep_pp"),
    ("get_expert_data_parallel_group", {}, "ep_dp"),
    ("get_expert_data_parallel_group_gloo", {}, "ep_dp_gloo"),
    ("get_intra_distributed_optimizer_instance_group", {}, "intra_dist_opt"),
    ("get_inter_distributed_optimizer_instance_group", {}, "inter_dist_opt"),
)


def label_for_desc(desc: str) -> str | None:
    """The vigil label of a Megatron group description, None for one Megatron does not make."""
    label = DESC_LABELS.get(desc)
    if label is not None:
        return label
    match = _HIERARCHICAL.fullmatch(desc)
    if match is not None:
        inner = DESC_LABELS.get(match["desc"])
        if inner is not None:
            return f"h{inner}{'_gloo' if match['gloo'] else ''}_l{match['level']}"[:16]
    match = _HYBRID.fullmatch(desc)
    if match is not None:
        return f"hdp_cp_{match['size']}"[:16]
    return None


def label_groups(parallel_state: Any = None) -> dict[str, list[int]]:
    """Label every process group this rank is in by its Megatron parallel dimension (call it
    on every rank after `initialize_model_parallel`, before or after `vigil.agent.init`).

    Returns label -> the global ranks of this rank's group of that label. ValueError when
    model parallelism is not initialised."""
    if parallel_state is None:
        from megatron.core import parallel_state as megatron_state

        parallel_state = megatron_state
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "megatron.core.parallel_state is not initialised: call "
            "initialize_model_parallel(...) before vigil.integrations.megatron.label_groups()"
        )
    import torch.distributed as dist

    labelled: dict[str, list[int]] = {}
    seen: set[str] = set()
    for group, fallback in _groups(parallel_state):
        name = getattr(group, "group_name", None)
        if not isinstance(name, str) or name in seen:
            continue
        seen.add(name)
        label = label_for_desc(str(getattr(group, "group_desc", "") or "")) or fallback
        if label is None:
            continue
        try:
            vigil.agent.label_group(group, label)
        except ValueError:  # the default group (a layout whose group is the whole job)
            log.debug("vigil: Megatron group %s (%s) left as it is", name, label)
            continue
        labelled.setdefault(label, dist.get_process_group_ranks(group))
    log.info("vigil: labelled Megatron process groups %s", ", ".join(sorted(labelled)))
    return labelled


def _groups(parallel_state: Any) -> Iterator[tuple[Any, str | None]]:
    """(group, getter label) for the public getters' groups, then (group, None) for the rest
    of the groups Megatron created that this rank is in."""
    for getter, kwargs, label in GETTERS:
        function = getattr(parallel_state, getter, None)
        if function is None:
            continue
        try:
            group = function(**kwargs)
        except (AssertionError, RuntimeError, TypeError):  # not built in this layout
            continue
        if group is not None:
            yield group, label
    for group in getattr(parallel_state, "_global_process_group_list", None) or ():
        if group is not None:
            yield group, None


def timed(forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
    """`forward_backward_func` (what `get_forward_backward_func()` returns) with its forward
    and backward time recorded in the current step (see the module docstring)."""
    if getattr(forward_backward_func, "__vigil_timed__", False):
        return forward_backward_func

    @functools.wraps(forward_backward_func)
    def run(*args: Any, **kwargs: Any) -> Any:
        forward_step_func = kwargs.get("forward_step_func")
        if kwargs.get("forward_only") or forward_step_func is None:
            return forward_backward_func(*args, **kwargs)
        rest = _Phase("backward")
        kwargs["forward_step_func"] = _timed_forward(forward_step_func, rest)
        with vigil.agent.span("pipeline"):  # a stage waits for its peers in here
            rest.open()
            try:
                return forward_backward_func(*args, **kwargs)
            finally:
                rest.close()

    run.__vigil_timed__ = True  # type: ignore[attr-defined]
    return run


def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable[..., Any]:
    """`megatron.core.pipeline_parallel.get_forward_backward_func(...)`, timed."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    return timed(megatron_func(*args, **kwargs))


def _timed_forward(forward_step_func: Callable[..., Any], rest: _Phase) -> Callable[..., Any]:
    # functools.wraps keeps the signature Megatron may inspect (checkpoint_activations_microbatch).
    @functools.wraps(forward_step_func)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        rest.close()
        try:
            with vigil.agent.span("forward"):
                return forward_step_func(*args, **kwargs)
        finally:
            rest.open()

    return forward_step


class _Phase:
    """A `vigil.agent.span` opened and closed around the parts of a schedule between forwards."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._span: contextlib.AbstractContextManager[None] | None = None

    def open(self) -> None:
        if self._span is None:
            span = vigil.agent.span(self._name)
            span.__enter__()
            self._span = span

    def close(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)
