"""A 2-rank gloo job in which rank 1 hangs deliberately at step HANG_STEP (test helper).

    python hang_job.py RANK WORLD PORT OUT_DIR PROGRESS_DIR

Every step sleeps a little and all-reduces once; at HANG_STEP rank 1 stops in `hang_here()`
before the step's all-reduce, so rank 0 waits in it. The test kills both processes.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist

import vigil.agent

JOB = "hangjob"
HANG_STEP = 8


def hang_here() -> None:
    while True:
        time.sleep(1.0)


def main(rank: int, world: int, port: int, out: str, progress_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(300)
    )
    vigil.agent.init(
        job=JOB,
        output_dir=out,
        progress_dir=progress_dir,
        measure_cpu_peak=False,
        flush_interval_s=0.25,
        min_hang_s=2.0,
        hang_factor=3.0,
    )
    for step in range(10_000):
        with vigil.agent.step(step, tokens=16):
            time.sleep(0.1)
            if step == HANG_STEP and rank == 1:
                hang_here()
            dist.all_reduce(torch.ones(1024))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
