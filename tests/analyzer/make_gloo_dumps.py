"""Records the real gloo Flight Recorder fixtures in data/fr_gloo_hang (run by hand, not by pytest).

Four gloo ranks with a tensor-parallel-like subgroup per pair: rank 3 never enters its
subgroup's all-reduce, so rank 2 waits there, and ranks 0 and 1 wait in the world all-reduce
that rank 2 never reaches. Each rank then dumps torch's Flight Recorder buffer in both
encodings: `pickle/gloo_trace_rank_<r>` (`_dump_fr_trace`) and `json/gloo_trace_rank_<r>.json`
(`_dump_fr_trace_json`). Usage: python tests/analyzer/make_gloo_dumps.py
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
import torch.multiprocessing as mp

OUT = Path(__file__).parent / "data" / "fr_gloo_hang"


def worker(rank: int, world: int, port: int) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
    store = dist.TCPStore(
        "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    t = torch.ones(8)
    for _ in range(3):  # three healthy "steps"
        dist.all_reduce(t, group=mine)
        dist.all_reduce(t)
    pending = None
    if rank in (0, 1):
        dist.all_reduce(t, group=mine)
        pending = dist.all_reduce(t, async_op=True)  # waits for ranks 2 and 3
    elif rank == 2:
        pending = dist.all_reduce(t, group=mine, async_op=True)  # waits for rank 3
    time.sleep(1.0)  # rank 3 "computes" forever
    (OUT / "pickle").mkdir(parents=True, exist_ok=True)
    (OUT / "json").mkdir(parents=True, exist_ok=True)
    (OUT / "pickle" / f"gloo_trace_rank_{rank}").write_bytes(c10d._dump_fr_trace())
    (OUT / "json" / f"gloo_trace_rank_{rank}.json").write_bytes(c10d._dump_fr_trace_json())
    del pending
    os._exit(0)  # the pending collectives can never finish


if __name__ == "__main__":
    mp.spawn(worker, args=(4, int(sys.argv[1]) if len(sys.argv) > 1 else 29611), nprocs=4)
