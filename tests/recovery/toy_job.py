"""A tiny data-parallel gloo job used by the recovery tests: resumes, checkpoints, can crash.

Environment: TOY_DIR (checkpoints and progress), TOY_STEPS (total steps), TOY_CRASH
("attempt:rank:step,..." — that rank exits with code 3 at that step of that attempt),
TOY_STEP_S (sleep per step). Rendezvous comes from the supervisor (torchrun-style env).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


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
    weight = torch.zeros(4)
    start = 0
    if ckpt.exists():
        saved = torch.load(ckpt)
        weight, start = saved["weight"], saved["step"] + 1
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
        if rank == 0:
            tmp = out / "ckpt.tmp"
            torch.save({"weight": weight, "step": step}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()
        log.write(f"{attempt} {step} {os.environ.get('VIGIL_NODE', '')} {world}\n")
        log.flush()
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
