"""A rank that needs no torch: counts steps into a file, resumes from it, can crash.

Used to exercise the controller's bookkeeping quickly (starting torch in every rank of 20 runs
would cost minutes). Environment: TOY_DIR, TOY_STEPS, TOY_STEP_S, TOY_CRASH
("attempt:rank:step,..."), plus the supervisor's RANK / VIGIL_RESTART_COUNT / VIGIL_NODE.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def main() -> int:
    out = Path(os.environ["TOY_DIR"])
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("VIGIL_RESTART_COUNT", "0"))
    steps = int(os.environ.get("TOY_STEPS", "10"))
    step_s = float(os.environ.get("TOY_STEP_S", "0.05"))
    crashes = {
        tuple(int(x) for x in spec.split(":"))
        for spec in os.environ.get("TOY_CRASH", "").split(",")
        if spec
    }
    progress = out / f"progress-rank{rank}.txt"
    done = [ln.split() for ln in progress.read_text().splitlines()] if progress.exists() else []
    start = max((int(p[1]) + 1 for p in done if p[2] != "crash"), default=0)
    with progress.open("a") as log:
        for step in range(start, steps):
            if (attempt, rank, step) in crashes:
                log.write(f"{attempt} {step} crash\n")
                log.flush()
                return 3
            time.sleep(step_s)
            log.write(f"{attempt} {step} {os.environ.get('VIGIL_NODE', '')}\n")
            log.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
