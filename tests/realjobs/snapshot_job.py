"""A user's own DDP training script with vigil's per-step snapshots, written as the README shows.

Plain PyTorch (DistributedDataParallel, or FSDP2 with `--wrapper fsdp`, over gloo, AdamW, a
warm-up LR schedule, dropout drawing from the global RNG) plus the SDK's calls: `init`, `watch`,
`step`, `snapshots`, `restore`, `save`, `shutdown`. Run under `vigil run`, which sets the
rendezvous, VIGIL_JOB, VIGIL_NODE, VIGIL_RESTART_COUNT and VIGIL_SNAPSHOT_DIR for every rank:

    vigil run --nproc 4 --nodes 2 -- python snapshot_job.py --out DIR --steps 12

The job keeps its own record, independent of vigil's: every rank appends one JSON line per
completed step to DIR/steps-rank<r>.jsonl (attempt, step, loss, a checksum of its weights or
shards) and one per start to DIR/starts-rank<r>.jsonl (attempt, the first step trained, where
the state came from). Faults (--fault, repeatable) are "attempt:rank:step:kind": kind `kill`
SIGKILLs the rank in the middle of that step (after backward, before the optimizer step); kind
`drop` first waits for every rank's snapshots to be written, deletes that rank's node's
snapshot folder (the node's shared memory is lost), then SIGKILLs it the same way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import vigil.agent

HIDDEN = 64


def parse_fault(text: str) -> tuple[int, int, int, str]:
    attempt, rank, step, kind = text.split(":")
    if kind not in ("kill", "drop"):
        raise argparse.ArgumentTypeError(f"fault kind {kind!r}: use kill or drop")
    return int(attempt), int(rank), int(step), kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--step-s", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--fault", type=parse_fault, action="append", default=[])
    parser.add_argument("--wrapper", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    attempt = int(os.environ.get("VIGIL_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, 4 * HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(4 * HIDDEN, HIDDEN),
    )
    if args.wrapper == "fsdp":  # FSDP2: each rank holds (and snapshots) its DTensor shards
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[3]):
            fully_shard(layer)
        model: torch.nn.Module = fully_shard(net)
    else:
        model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    job = os.environ.get("VIGIL_JOB", "snapshot-job")
    vigil.agent.init(job=job, output_dir=args.out / "vigil")
    vigil.agent.watch(model, optimizer)

    # The documented snapshot calls: register the state, restore, then save after each step.
    snaps = vigil.agent.snapshots(model, optimizer, extra={"schedule": schedule}, rng=True)
    start = snaps.restore() or 0

    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"starts-rank{rank}.jsonl").open("a") as fh:
        fh.write(json.dumps({"attempt": attempt, "first_step": start,
                             "source": snaps.restored_from or "scratch"}) + "\n")  # fmt: skip
    record = (args.out / f"steps-rank{rank}.jsonl").open("a")
    faults = {(a, r, s): kind for a, r, s, kind in args.fault}
    drops = {(a, s) for a, _, s, kind in args.fault if kind == "drop"}
    for step in range(start, args.steps):
        with vigil.agent.step(step, tokens=32) as handle:
            g = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(32, HIDDEN, generator=g)
            loss = (model(x) - x.roll(1, dims=1)).pow(2).mean()
            loss.backward()
            if (attempt, step) in drops:  # every rank's snapshots are written before the loss
                snaps.flush()
                dist.barrier()
            fault = faults.get((attempt, rank, step))
            if fault is not None:
                die(fault)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            handle.set_loss(loss.detach())
        snaps.save(step)
        time.sleep(args.step_s)
        checksum = float(sum(_local(p).detach().double().sum() for p in model.parameters()))
        stats = snaps.stats
        record.write(json.dumps({"attempt": attempt, "step": step, "loss": loss.item(),
                                 "checksum": checksum, "snapshots_saved": stats.num_saved,
                                 "snapshots_skipped": stats.num_skipped}) + "\n")  # fmt: skip
        record.flush()
    snaps.close()
    vigil.agent.shutdown()
    dist.destroy_process_group()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def die(kind: str) -> None:
    if kind == "drop":
        node_dir = Path(os.environ["VIGIL_SNAPSHOT_DIR"]) / os.environ["VIGIL_JOB"]
        shutil.rmtree(node_dir / os.environ["VIGIL_NODE"], ignore_errors=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
