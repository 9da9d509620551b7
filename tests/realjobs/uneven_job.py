"""A user's DDP training loop whose data shards are uneven, or whose rank hangs for good.

    torchrun --standalone --nproc-per-node 4 uneven_job.py --mode exit|barrier|stuck

Each rank trains on its own shard of a dataset split without padding (no DistributedSampler):
rank 3's shard holds 30 batches, the others' 40 (in `stuck` mode every shard holds 40). The
process group's timeout is 15 s, so a stalled job fails as real ones do, only sooner.

- `exit`: every rank leaves its loop when its data runs out, shuts vigil down and destroys the
  process group: rank 3 leaves while its peers are in their step 30's all-reduce.
- `barrier`: each rank waits at `dist.barrier()` after its loop: rank 3's barrier meets its
  peers' all-reduce, and the job hangs until the timeout fails it.
- `stuck`: rank 2 blocks before its step 12 (a lock never released, an input never coming)
  until the timeout fails its peers and torchrun stops it.

vigil is added as the README says; nothing else in the loop knows about it.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import vigil.agent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("exit", "barrier", "stuck"), required=True)
    mode = parser.parse_args().mode
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    vigil.agent.init(job=f"uneven-{mode}", also_jsonl=True)
    vigil.agent.watch(ddp, opt)
    generator = torch.Generator().manual_seed(rank)
    shard = [
        torch.randn(64, 256, generator=generator)
        for _ in range(30 if rank == 3 and mode != "stuck" else 40)
    ]
    for step, x in enumerate(shard):
        if mode == "stuck" and rank == 2 and step == 12:
            time.sleep(3600)
        with vigil.agent.step(step, tokens=x.shape[0]) as s:
            loss = ddp(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.set_loss(loss.detach())
    if mode == "barrier":
        dist.barrier()
    vigil.agent.shutdown()
    del ddp, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
