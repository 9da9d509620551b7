"""One rank that trains a few steps while its collector is away, then exits (test helper).

    python spool_job.py COLLECTOR_URL PROGRESS_DIR STEPS

Its batches, the FINISHED heartbeat last, stay in `<PROGRESS_DIR>/spooljob/<run>/rank-00000.spool`.
"""

from __future__ import annotations

import sys

import vigil.agent

JOB = "spooljob"


def main(collector: str, progress_dir: str, steps: int) -> None:
    vigil.agent.init(
        job=JOB,
        collector=collector,
        progress_dir=progress_dir,
        rank=0,
        world_size=1,
        measure_cpu_peak=False,
        flush_interval_s=0.05,
        shutdown_timeout_s=1.0,
    )
    for step in range(steps):
        with vigil.agent.step(step, tokens=8) as s:
            s.set_loss(1.0 / (step + 1))
    vigil.agent.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
