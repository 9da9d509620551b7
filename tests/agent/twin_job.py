"""One rank of a small gloo job that parks before its shutdown until told to go (test helper).

    MASTER_ADDR=... MASTER_PORT=... RANK=r WORLD_SIZE=w VIGIL_PROGRESS_DIR=... \\
        python twin_job.py OUT_DIR GATE_DIR

The launcher's environment alone decides where the progress pages go (no progress_dir given):
`$VIGIL_PROGRESS_DIR/twin/<run id from MASTER_ADDR:MASTER_PORT>/`. After a few steps the rank
writes `GATE_DIR/ready-<port>-<rank>` holding its page's path, waits for `GATE_DIR/go` (at most
60 s) and shuts down cleanly.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import vigil.agent

JOB = "twin"


def main(out: str, gate: str) -> None:
    dist.init_process_group("gloo")
    session = vigil.agent.init(job=JOB, output_dir=out, measure_cpu_peak=False)
    assert session is not None
    for step in range(3):
        with vigil.agent.step(step, tokens=8):
            dist.all_reduce(torch.ones(64))
    marker = Path(gate) / f"ready-{os.environ['MASTER_PORT']}-{dist.get_rank()}"
    marker.with_suffix(".tmp").write_text(str(session.page.path))
    marker.with_suffix(".tmp").rename(marker)
    deadline = time.monotonic() + 60
    while not (Path(gate) / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    vigil.agent.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
