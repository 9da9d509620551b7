"""A user's own gloo loop instrumented with the SDK as the README shows, for `vigil run` tests.

Environment: TOY_DIR (checkpoints), TOY_STEPS, TOY_STEP_S, TOY_CKPT_EVERY (each rank saves its
step every N steps, default 3), TOY_KILL ("attempt:rank:step": that rank SIGKILLs itself as that
step begins). Prints one line per step, so the console echo has something to show. No
collector: the SDK writes JSONL under $VIGIL_OUTPUT_DIR, progress pages under the progress root.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import vigil.agent


def main() -> None:
    out = Path(os.environ["TOY_DIR"])
    steps = int(os.environ.get("TOY_STEPS", "8"))
    step_s = float(os.environ.get("TOY_STEP_S", "0.05"))
    every = int(os.environ.get("TOY_CKPT_EVERY", "3"))
    attempt = int(os.environ.get("VIGIL_RESTART_COUNT", "0"))
    kill = tuple(int(x) for x in os.environ.get("TOY_KILL", "-1:-1:-1").split(":"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    vigil.agent.init(job=os.environ["VIGIL_JOB"])
    ckpt = out / f"ckpt-rank{rank}.txt"
    start = int(ckpt.read_text()) + 1 if ckpt.exists() else 0
    print(f"attempt {attempt} resumes at step {start}", flush=True)
    for step in range(start, steps):
        if (attempt, rank, step) == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        with vigil.agent.step(step):
            grad = torch.ones(4)
            dist.all_reduce(grad)
            time.sleep(step_s)
        print(f"step {step} done", flush=True)
        if step % every == every - 1:
            ckpt.write_text(str(step))
    vigil.agent.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
