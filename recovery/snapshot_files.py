"""Where per-step snapshots live in node shared memory, and how whole nodes' or jobs' go away.

No torch here, so the supervisor can manage snapshot folders without importing it; the
snapshots themselves are written and read by `vigil.recovery.snapshot` inside the ranks.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

# /dev/shm is RAM-backed and survives the training process; fall back to the temp dir elsewhere.
DEFAULT_ROOT = Path("/dev/shm/vigil-snapshots") if Path("/dev/shm").is_dir() else Path("/tmp")
STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


def drop_node(root: Path, job: str, node: str) -> None:
    """Forget a node's shared memory (what losing the machine does; simulated nodes)."""
    shutil.rmtree(root / job / node, ignore_errors=True)


def drop_job(root: Path, job: str) -> None:
    """Free a finished job's snapshots."""
    shutil.rmtree(root / job, ignore_errors=True)
