"""Pipeline parallelism with torch.distributed.pipelining: split layers into stages, build the
schedule (GPipe, 1F1B, interleaved 1F1B) and run one step of it.

Stages are assigned round-robin ("looped"): virtual stage s runs on pp rank s % pp, so with one
stage per rank stage s is rank s. This module owns no process groups; it is given the pp group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase

from vigil.trainer import model as model_lib
from vigil.trainer import recipes


def split_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous, as-even-as-possible layer ranges; earlier stages take the remainder."""
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def stages_of_rank(pp_rank: int, par: recipes.ParallelConfig) -> list[int]:
    return [pp_rank + k * par.pp for k in range(par.stages_per_rank)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Which virtual stages, and which layers, one pp rank holds."""

    stage_ids: list[int]
    layers_by_stage: list[list[int]]
    num_stages: int

    @property
    def layer_ids(self) -> list[int]:
        return sorted(i for ids in self.layers_by_stage for i in ids)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def plan_for(pp_rank: int, recipe: recipes.Recipe) -> StagePlan:
    par = recipe.parallel
    num_stages = par.pp * par.stages_per_rank
    ranges = split_layers(recipe.model.n_layers, num_stages)
    ids = stages_of_rank(pp_rank, par)
    return StagePlan(stage_ids=ids, layers_by_stage=[ranges[s] for s in ids], num_stages=num_stages)


def stage_modules(owner: model_lib.Transformer, plan: StagePlan) -> list[model_lib.Transformer]:
    """One module per virtual stage; with a single stage it is the rank's model itself."""
    if len(plan.stage_ids) == 1:
        return [owner]
    return [
        model_lib.StageView(owner, ids, first=s == 0, last=s == plan.num_stages - 1)
        for s, ids in zip(plan.stage_ids, plan.layers_by_stage, strict=True)
    ]


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_schedule(
    modules: list[model_lib.Transformer],
    plan: StagePlan,
    *,
    par: recipes.ParallelConfig,
    group: dist.ProcessGroup,
    device: torch.device,
    loss_fn: LossFn,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    stages: list[_PipelineStageBase] = [
        PipelineStage(module, s, plan.num_stages, device, group=group)
        for module, s in zip(modules, plan.stage_ids, strict=True)
    ]
    n_mb = par.num_microbatches
    kind = par.pipeline_schedule
    if kind is recipes.PipelineSchedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B(stages, n_mb, loss_fn=loss_fn)
    single = ScheduleGPipe if kind is recipes.PipelineSchedule.GPIPE else Schedule1F1B
    return single(stages[0], n_mb, loss_fn=loss_fn)


def run_step(
    schedule: PipelineScheduleSingle | PipelineScheduleMulti,
    plan: StagePlan,
    inputs: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor | None:
    """Forward and backward of one batch; the mean microbatch loss on the last stage, else None."""
    losses: list[torch.Tensor] = []
    target = labels if plan.has_last else None
    if plan.has_first:
        schedule.step(inputs, target=target, losses=losses, return_outputs=False)
    else:
        schedule.step(target=target, losses=losses, return_outputs=False)
    if not plan.has_last:
        return None
    return torch.stack([loss.detach().float() for loss in losses]).mean()
