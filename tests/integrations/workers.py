"""Run a function on N spawned processes joined in one gloo group, each with a vigil SDK
session of its own (no collector: records go to `<out>/`), as the group-label and Megatron
tests need."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path

from tests.realjobs import launch as launcher


def join(rank: int, world: int, port: int, out: str, *, job: str, timeout_s: float) -> None:
    """In a worker: torchrun's environment, a gloo process group, then `vigil.agent.init`."""
    import torch
    import torch.distributed as dist

    import vigil.agent

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    vigil.agent.init(
        job=job, collector=None, output_dir=out, progress_dir=f"{out}/pages", run_id=job[0]
    )


def spawn(target: Callable[[int, int, str], None], out: Path, world: int, timeout_s: float) -> None:
    """`target(rank, port, out)` on `world` spawned processes; all must exit 0 in time."""
    ctx = multiprocessing.get_context("spawn")
    port = launcher.free_port()
    procs = [ctx.Process(target=target, args=(r, port, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert [p.exitcode for p in procs] == [0] * world
