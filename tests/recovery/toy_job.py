"""A tiny data-parallel gloo job used by the recovery tests: resumes, checkpoints, can crash.

Environment: TOY_DIR (checkpoints and progress), TOY_STEPS (total steps), TOY_CRASH
("attempt:rank:step,..." — that rank exits with code 3 at that step of that attempt),
TOY_STEP_S (sleep per step), TOY_CKPT_EVERY (persistent checkpoint interval, default 3).
A per-step in-memory snapshot (vigil.recovery.snapshot) is taken when VIGIL_SNAPSHOT_DIR is set;
on start the job resumes from whichever is newer. Rendezvous comes from the supervisor.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vigil.recovery.snapshot import Snapshotter


def main() -> None:
    out = Path(os.environ["TOY_DIR"])
    steps = int(os.environ.get("TOY_STEPS", "8"))
    step_s = float(os.environ.get("TOY_STEP_S", "0.05"))
    attempt = int(os.environ.get("VIGIL_RESTART_COUNT", "0"))
    crashes = {
        tuple(int(x) for x in spec.split(":"))
        for spec in os.environ.get("TOY_CRASH", "").split(",")
        if spec
    }
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = out / "ckpt.pt"
    every = int(os.environ.get("TOY_CKPT_EVERY", "3"))
    snaps = None
    if os.environ.get("VIGIL_SNAPSHOT_DIR"):
        snaps = Snapshotter(
            job=os.environ["VIGIL_JOB"],
            node=os.environ["VIGIL_NODE"],
            rank=rank,
            world_size=world,
            ranks_per_node=int(os.environ["LOCAL_WORLD_SIZE"]),
            root=Path(os.environ["VIGIL_SNAPSHOT_DIR"]),
        )
    weight, start, source = torch.zeros(4), 0, "scratch"
    if ckpt.exists():
        saved = torch.load(ckpt)
        weight, start, source = saved["weight"], saved["step"] + 1, "checkpoint"
    newest = snaps.newest() if snaps else None
    if newest is not None and newest.step + 1 > start:
        state = snaps.load(newest)  # type: ignore[union-attr]
        weight, start = state["weight"], newest.step + 1
        source = "replica" if newest.replica else "snapshot"
    with (out / f"resume-rank{rank}.txt").open("a") as f:
        f.write(f"{attempt} {source} {start}\n")
    log = (out / f"progress-rank{rank}.txt").open("a")
    for step in range(start, steps):
        if (attempt, rank, step) in crashes:
            log.write(f"{attempt} {step} crash\n")
            log.close()
            os._exit(3)
        grad = torch.full((4,), float(rank + 1))
        dist.all_reduce(grad)
        weight -= 0.01 * grad / world
        time.sleep(step_s)
        if snaps is not None:
            snaps.save(step, {"weight": weight})
        if rank == 0 and step % every == every - 1:
            tmp = out / "ckpt.tmp"
            torch.save({"weight": weight, "step": step}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()
        log.write(f"{attempt} {step} {os.environ.get('VIGIL_NODE', '')} {world}\n")
        log.flush()
    log.close()
    if rank == 0:
        torch.save({"weight": weight}, out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
