"""Multi-process harness for the trainer tests: N real gloo CPU ranks (torch.multiprocessing
spawn) that run a list of cases inside one process group, so many layouts share one launch.

Each case is (name, recipe, stop_after). Rank 0 writes `<out>/<name>.json` with the per-step
losses and the step it resumed from.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import resource
import socket
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from vigil.trainer import assembly, loop, parallel, recipes, runtime


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    recipe: recipes.Recipe
    stop_after: int | None = None


def small_recipe(**changes: object) -> recipes.Recipe:
    """The tiny recipe with 4 layers (so pp=4 and interleaved 2x2 stages fit), 10 steps.

    Its gradient norms (1.2 to 3.5) exceed the clip threshold (1.0) on every step, so clipping
    acts throughout and each layout's global-norm computation (DTensor shards, pipeline stages)
    must be right for the losses to match.
    """
    base = recipes.named("tiny", steps=10)
    model = dataclasses.replace(base.model, n_layers=4)
    return base.replace(model=model, **changes)


def with_parallel(recipe: recipes.Recipe, **changes: object) -> recipes.Recipe:
    return recipe.replace(parallel=dataclasses.replace(recipe.parallel, **changes))


def with_checkpoint(recipe: recipes.Recipe, **changes: object) -> recipes.Recipe:
    return recipe.replace(checkpoint=dataclasses.replace(recipe.checkpoint, **changes))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world: int, port: int, cases: list[Case], out: str) -> None:
    launch = runtime.LaunchEnv(
        rank=rank, world_size=world, local_world_size=world, master_port=port
    )
    device = runtime.pick_device(launch, force_cpu=True)
    runtime.init_process_group(launch, device, timeout=datetime.timedelta(seconds=60))
    try:
        for case in cases:
            ctx = loop.RunContext(rank=rank, world_size=world, device=device)
            with loop.trainer_session(case.recipe, ctx=ctx) as trainer:
                result = trainer.train(stop_after=case.stop_after)
            if rank == 0:
                record = {
                    "grad_norms": [s.grad_norm for s in result.history],
                    "start_step": result.start_step,
                    "exit_code": int(result.exit_code),
                    "losses": {str(k): v for k, v in result.losses.items()},
                }
                (Path(out) / f"{case.name}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def run_cases(world: int, cases: list[Case], out: Path) -> dict[str, dict[str, object]]:
    """Run every case on `world` spawned ranks; returns rank 0's results by case name."""
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world, _free_port(), cases, str(out)), nprocs=world, join=True)
    return {c.name: json.loads((out / f"{c.name}.json").read_text()) for c in cases}


def reference_losses(recipe: recipes.Recipe, *, stop_after: int | None = None) -> loop.TrainResult:
    """The same recipe trained by this process alone, with no process group."""
    single = with_parallel(recipe, dp=1, dp_replicate=1, tp=1, pp=1, stages_per_rank=1)
    single = single.replace(
        parallel=dataclasses.replace(
            single.parallel,
            data_parallel=recipes.DataParallel.FSDP,
            pipeline_schedule=recipes.PipelineSchedule.ONE_F_ONE_B,
        )
    )
    with loop.trainer_session(single, ctx=loop.RunContext()) as trainer:
        return trainer.train(stop_after=stop_after)


def _assemble_worker(rank: int, world: int, port: int, recipe: recipes.Recipe, out: str) -> None:
    launch = runtime.LaunchEnv(
        rank=rank, world_size=world, local_world_size=world, master_port=port
    )
    device = runtime.pick_device(launch, force_cpu=True)
    runtime.init_process_group(launch, device, timeout=datetime.timedelta(seconds=120))
    try:
        mesh = parallel.build_mesh(recipe.parallel, device.type)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        parts = assembly.assemble(recipe, mesh=mesh, device=device)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in parts.owner.parameters()]
        record = {
            "peak_growth_bytes": grown,
            "held_bytes": sum(t.numel() * t.element_size() for t in locals_),
            "devices": sorted({t.device.type for t in locals_}),
        }
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps(record))
        del parts
    finally:
        dist.destroy_process_group()


def assemble_only(world: int, recipe: recipes.Recipe, out: Path) -> list[dict[str, object]]:
    """Each rank assembles `recipe` (no training); per rank: how much its peak resident memory
    grew while assembling, and the bytes of the parameters it holds."""
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_assemble_worker, args=(world, _free_port(), recipe, str(out)), nprocs=world)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
