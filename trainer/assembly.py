"""Assemble what one rank trains: its part of the model (pipeline stages), parallelized on the
job's mesh, the optimizer over it, and the pipeline schedule when pp > 1.

Every rank builds the whole model on the meta device, keeps only its stages, parallelises them,
and only then allocates and initialises its shard (`model.materialize`): all layouts start from
the same weights as a single-process run, and no rank ever holds the whole of a large model.
This module decides nothing about steps or checkpoints.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from vigil.trainer import model as model_lib
from vigil.trainer import parallel, pipeline, recipes


@dataclasses.dataclass(kw_only=True)
class Assembled:
    owner: model_lib.Transformer  # every parameter this rank holds, under full-model names
    module: nn.Module  # what runs forward when pp == 1 (the owner, or its DDP wrapper)
    optimizer: torch.optim.Optimizer
    plan: pipeline.StagePlan | None
    schedule: PipelineScheduleSingle | PipelineScheduleMulti | None
    fsdp: bool
    ddp: bool

    @property
    def has_loss(self) -> bool:
        """Whether this rank computes the loss (under PP only last-stage ranks do)."""
        return self.plan is None or self.plan.has_last


def lr_at(step: int, recipe: recipes.Recipe) -> float:
    """Linear warmup to lr, then cosine decay to lr x min_lr_ratio at the last step."""
    opt = recipe.optim
    if opt.warmup_steps and step <= opt.warmup_steps:
        return opt.lr * step / opt.warmup_steps
    span = max(1, recipe.steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / span)
    floor = opt.lr * opt.min_lr_ratio
    return floor + (opt.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _optimizer(params: list[nn.Parameter], recipe: recipes.Recipe) -> torch.optim.Optimizer:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]  # norms
    groups = [
        {"params": decay, "weight_decay": recipe.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(1, recipe), betas=recipe.optim.betas, foreach=True)


def assemble(recipe: recipes.Recipe, *, mesh: DeviceMesh | None, device: torch.device) -> Assembled:
    par = recipe.parallel
    owner = model_lib.skeleton(recipe.model)
    plan = None
    if par.pp > 1:
        assert mesh is not None
        plan = pipeline.plan_for(mesh["pp"].get_local_rank(), recipe)
        owner.keep_only(plan.layer_ids, first=plan.has_first, last=plan.has_last)
    if par.tp > 1:
        assert mesh is not None
        parallel.apply_tp(owner, mesh["tp"], sequence_parallel=par.sequence_parallel)
    parallel.apply_activation_checkpointing(owner, recipe.activation_checkpoint)
    if recipe.compile:
        for block in owner.layers.values():
            block.compile()  # in place: parameter names (and checkpoints) stay the same
    stages = pipeline.stage_modules(owner, plan) if plan is not None else [owner]
    fsdp = parallel.uses_fsdp(recipe)
    ddp = par.dp_total > 1 and not fsdp
    module: nn.Module = owner
    if fsdp:
        assert mesh is not None
        parallel.apply_fsdp(owner, stages, mesh, recipe)
    views = [s for s in stages if s is not owner]
    model_lib.materialize(owner, views, seed=recipe.data.seed, device=device)
    if ddp:
        assert mesh is not None
        module = parallel.apply_ddp(owner, mesh, device)
    schedule = None
    if plan is not None:
        assert mesh is not None
        schedule = pipeline.build_schedule(
            stages,
            plan,
            par=par,
            group=mesh["pp"].get_group(),
            device=device,
            loss_fn=model_lib.cross_entropy,
        )
    optimizer = _optimizer(list(owner.parameters()), recipe)
    return Assembled(
        owner=owner,
        module=module,
        optimizer=optimizer,
        plan=plan,
        schedule=schedule,
        fsdp=fsdp,
        ddp=ddp,
    )
