"""A tiny SDK rank whose checkpoint callback writes a marker file (test helper).

    python control_job.py RANK WORLD COLLECTOR_URL PROGRESS_DIR OUT_DIR

Each rank trains short steps forever under job `ctljob` (reporting to the collector) and, when a
checkpoint request reaches it (`vigil.agent.on_control`), writes `OUT_DIR/checkpoint-rank-R`
holding the step it ran at; rank 0 then reports the commit (`vigil.agent.checkpoint_committed`).
The test kills it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import vigil.agent

JOB = "ctljob"


def main(rank: int, world: int, url: str, progress_dir: str, out: str) -> None:
    vigil.agent.init(
        job=JOB,
        collector=url,
        progress_dir=progress_dir,
        output_dir=out,
        rank=rank,
        world_size=world,
        measure_cpu_peak=False,
        flush_interval_s=0.25,
    )
    current = [0]
    marker = Path(out) / f"checkpoint-rank-{rank}"

    def checkpoint() -> None:
        marker.write_text(str(current[0]))
        if rank == 0:  # one rank reports the commit, as a trainer's rank 0 does
            vigil.agent.checkpoint_committed(current[0], location=str(marker))

    vigil.agent.on_control("checkpoint", checkpoint)
    for step in range(1_000_000):
        current[0] = step
        with vigil.agent.step(step, tokens=8):
            time.sleep(0.05)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
