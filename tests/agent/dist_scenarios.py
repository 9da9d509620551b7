"""A 4-rank gloo job exercising DDP, FSDP2, tensor parallelism, async and point-to-point ops.

Run one process per rank (the test launches them):
    python dist_scenarios.py RANK WORLD PORT OUT_DIR PROGRESS_DIR
Step ranges: DDP 0-2, FSDP2 10-12, tensor parallel (Megatron-style) 20-22, DTensor tensor
parallel 40-42, async + p2p 30, a known delay 50 (rank LATE_RANK enters a world all-reduce
LATE_S after the others, which are released together). The SDK writes JSONL
under OUT_DIR and leaves each rank's progress page (with its ring buffer) under PROGRESS_DIR.
"""

from __future__ import annotations

import datetime
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import vigil.agent

JOB = "scenarios"
HIDDEN = 32
BATCH = 8
LATE_RANK, LATE_S = 3, 0.2


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN)
    )


def train(model: torch.nn.Module, steps: range) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    vigil.agent.watch(model, opt)
    for i in steps:
        with vigil.agent.step(i, tokens=BATCH) as s:
            loss = model(torch.randn(BATCH, HIDDEN)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.set_loss(loss)
    del opt


class _AllReduceForward(torch.autograd.Function):
    """Megatron's row-parallel output: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    """Megatron's column-parallel input: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class TensorParallelMLP(torch.nn.Module):
    def __init__(self, group: Any, tp: int) -> None:
        super().__init__()
        self.group = group
        self.up = torch.nn.Linear(HIDDEN, HIDDEN // tp)
        self.down = torch.nn.Linear(HIDDEN // tp, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _AllReduceBackward.apply(x, self.group)
        return _AllReduceForward.apply(self.down(torch.relu(self.up(x))), self.group)


def store_barrier(store: Any, name: str, world: int) -> None:
    """Every rank leaves when the last one arrives: it sets a key the others block on."""
    if store.add(f"{name}:arrived", 1) == world:
        store.set(f"{name}:go", "1")
    store.wait([f"{name}:go"], datetime.timedelta(seconds=60))


def main(rank: int, world: int, port: int, out: str, progress_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    vigil.agent.init(
        job=JOB,
        output_dir=out,
        progress_dir=progress_dir,
        measure_cpu_peak=False,
        flush_interval_s=0.2,
        peak_flops=1e12,
        flops_per_token=6.0 * 2 * HIDDEN * HIDDEN,
    )

    ddp = torch.nn.parallel.DistributedDataParallel(mlp())
    train(ddp, range(0, 3))
    del ddp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    sharded = mlp()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    train(sharded, range(10, 13))
    del sharded

    tp_groups = [dist.new_group([r, r + 1], group_desc="tp") for r in range(0, world, 2)]
    torch.manual_seed(rank // 2)
    train(TensorParallelMLP(tp_groups[rank // 2], 2), range(20, 23))

    # DTensor tensor parallelism (torch-native, as torchtitan does it): functional collectives.
    mesh_2d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dtensor_tp = parallelize_module(
        mlp(), mesh_2d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    train(dtensor_tp, range(40, 43))
    del dtensor_tp

    with vigil.agent.step(30):
        work = dist.all_reduce(torch.ones(256), async_op=True)
        work.wait()
        right, left = (rank + 1) % world, (rank - 1) % world
        send = dist.isend(torch.full((64,), float(rank)), right)
        inbox = torch.empty(64)
        dist.recv(inbox, left)
        send.wait()
        assert inbox[0].item() == left

    # Released together through the store (no collective, so nothing the SDK records), then
    # one rank enters the all-reduce LATE_S after the others: they wait LATE_S in it.
    store_barrier(store, "late", world)
    with vigil.agent.step(50):
        if rank == LATE_RANK:
            time.sleep(LATE_S)
        dist.all_reduce(torch.ones(16))
    # A copy of the page for the test to read the ring from: a clean shutdown removes the run's
    # progress folder (the last rank out), page and all.
    session = vigil.agent.current()
    assert session is not None
    session.recorder.publish()  # DDP's buckets reach the ring from the flusher, each interval
    kept = Path(out) / "kept-pages"
    kept.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(session.page.path, kept / session.page.path.name)
    vigil.agent.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
