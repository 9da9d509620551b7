"""A user's DDP training loop that checkpoints, crashes and is restarted by torchrun.

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 restart_job.py --checkpoint DIR \
        [--crash kill|raise]

Rank 0 saves the model, the optimizer and the step every `EVERY` steps (the ranks meet at a
barrier after it); every rank resumes from the newest save at start. In the first attempt rank
3 is killed at step `CRASH_AT` (`--crash kill`: SIGKILL, as the kernel's OOM killer does) or
raises there (`--crash raise`: a CUDA error, a bad batch): its peers' all-reduce breaks, or
torchrun stops them with SIGTERM first, and torchrun relaunches the job, which trains again
from the step after the save. In the second attempt rank 1 runs slower from step `SLOW_FROM`
on (it sleeps `SLOW_S` before each forward pass: a slower GPU's CPU thread waits likewise),
until step `STEPS`.

vigil is added as the README says (`init`, `watch`, `step`); nothing else in the loop knows
about it.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import vigil.agent

STEPS = 90
EVERY = 30
CRASH_AT = 58
SLOW_FROM = 34
SLOW_S = 0.03


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--crash", choices=("kill", "raise"), default="kill")
    args = parser.parse_args()
    saved = args.checkpoint / "state.pt"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun's store outlives an attempt: each attempt's process group keys its own.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    first = 0
    if saved.exists():
        state = torch.load(saved, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = int(state["step"]) + 1
    ddp = DistributedDataParallel(model)
    vigil.agent.init(job=f"restarted-{args.crash}", also_jsonl=True)
    vigil.agent.watch(ddp, opt)
    generator = torch.Generator().manual_seed(rank)
    for step in range(first, STEPS):
        x = torch.randn(128, 512, generator=generator)
        if attempt == 0 and rank == 3 and step == CRASH_AT:
            if args.crash == "raise":
                raise RuntimeError(f"rank 3 cannot go on at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        with vigil.agent.step(step, tokens=x.shape[0]) as s:
            if attempt > 0 and rank == 1 and step >= SLOW_FROM:
                time.sleep(SLOW_S)
            loss = ddp(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.set_loss(loss.detach())
        if step % EVERY == EVERY - 1:
            if rank == 0:
                tmp = saved.with_suffix(".tmp")
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.save(state, tmp)
                tmp.replace(saved)
            dist.barrier()
    vigil.agent.shutdown()
    del ddp, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
