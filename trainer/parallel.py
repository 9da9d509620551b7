"""Apply a recipe's parallel layout to a model: one DeviceMesh, then TP, activation checkpointing,
and FSDP2/HSDP or DDP, in that order (the order torchtitan uses, so DTensor layouts compose).

The mesh has four named dimensions, ("pp", "dp_replicate", "dp", "tp"); sizes of 1 are kept so
code can always slice by name. DDP's gradient all-reduce is routed through a Python comm hook that
calls `torch.distributed.all_reduce`, so collective timing in the SDK sees it. This module changes
modules in place and creates no process groups beyond the mesh's own.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from vigil.trainer import model as model_lib
from vigil.trainer import recipes

log = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp_replicate", "dp", "tp")


def build_mesh(par: recipes.ParallelConfig, device_type: str) -> DeviceMesh:
    """The job's one DeviceMesh over the default process group."""
    shape = (par.pp, par.dp_replicate, par.dp, par.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def dp_coordinates(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(dp rank, dp size) across both data-parallel dimensions."""
    if mesh is None:
        return 0, 1
    rep, shard = mesh["dp_replicate"], mesh["dp"]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()


def _tp_block_plan(sequence_parallel: bool) -> dict[str, Any]:
    if not sequence_parallel:
        return {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tp(
    module: model_lib.Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool
) -> None:
    """Megatron-style column/row sharding of every block; norms sharded over the sequence (SP)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {}
    if module.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if module.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if module.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if top:
        parallelize_module(module, tp_mesh, top)
    plan = _tp_block_plan(sequence_parallel)
    for block in module.layers.values():
        parallelize_module(block, tp_mesh, plan)


def apply_activation_checkpointing(
    module: model_lib.Transformer, mode: recipes.ActivationCheckpoint
) -> None:
    """Full: recompute every block in backward. Selective: every other block."""
    if mode is recipes.ActivationCheckpoint.NONE:
        return
    every = 1 if mode is recipes.ActivationCheckpoint.FULL else 2
    for position, key in enumerate(list(module.layers)):
        if position % every == 0:
            module.layers[key] = checkpoint_wrapper(module.layers[key], preserve_rng_state=False)


def _mp_policy(precision: recipes.Precision) -> MixedPrecisionPolicy:
    if precision is recipes.Precision.BF16:
        # bf16 compute, fp32 gradient reduction so small updates survive the sum.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(
    owner: model_lib.Transformer,
    roots: list[model_lib.Transformer],
    mesh: DeviceMesh,
    recipe: recipes.Recipe,
) -> None:
    """fully_shard each block, then each root (a stage's embedding/norm/head stay in the root)."""
    par = recipe.parallel
    hsdp = par.data_parallel is recipes.DataParallel.HSDP
    dp_mesh = mesh["dp_replicate", "dp"] if hsdp else mesh["dp"]
    policy = _mp_policy(recipe.precision)
    # Under PP every microbatch runs forward again; keeping gathered params avoids re-gathering.
    reshard = par.pp == 1
    for block in owner.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def _hooked_allreduce(
    group: dist.ProcessGroup, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through the Python collective API (visible to the SDK)."""
    buffer = bucket.buffer().div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    assert work is not None
    reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return reduced


# DDP inspects the hook's signature and wants the real class, not the postponed string.
_hooked_allreduce.__annotations__.update(
    bucket=GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def apply_ddp(module: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    group = mesh["dp"].get_group()
    ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(module, device_ids=ids, process_group=group)
    wrapped.register_comm_hook(group, _hooked_allreduce)
    return wrapped


def needs_autocast(recipe: recipes.Recipe, *, fsdp: bool) -> bool:
    """bf16 without FSDP's mixed-precision policy runs the forward under autocast instead."""
    return recipe.precision is recipes.Precision.BF16 and not fsdp


def uses_fsdp(recipe: recipes.Recipe) -> bool:
    par = recipe.parallel
    return par.dp_total > 1 and par.data_parallel is not recipes.DataParallel.DDP
