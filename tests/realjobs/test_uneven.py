"""vigil on the stalls real DDP jobs end in: uneven data and a rank stuck for good.

`uneven_job.py` is a user's DDP loop (vigil added as the README says) whose ranks' data shards
are uneven, launched by torchrun with a 15 s collective timeout, so each stall ends in failed
ranks as real jobs' do, only sooner. What `vigil analyze --json` must name, as a user runs it:

- a rank whose data ran out and that left its loop while its peers were in a collective
  (their collectives then broke): that rank, not the first peer to fail;
- a rank whose data ran out and that waits at the barrier after its loop while its peers wait
  in their all-reduce: a desync naming that rank, and the crash its timeout ends in, too;
- a rank blocked for good before its step: a hang naming it, and the crash its peers' timeout
  ends in, too (before, that crash named the first peer to time out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("uneven_job.py")
MODES = ("exit", "barrier", "stuck")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("uneven")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")},
        "VIGIL_OUTPUT_DIR": str(base / "out"),
        "VIGIL_PROGRESS_DIR": str(base / "pages"),
        "OMP_NUM_THREADS": "1",
    }
    for mode in MODES:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--log-dir", str(base / "torchrun")]  # not a fresh folder left in /tmp
        cmd += ["--nproc-per-node", "4", str(SCRIPT), "--mode", mode]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        # Every mode ends in failed ranks: torchrun reports the job failed.
        assert done.returncode != 0, (mode, done.stdout[-2000:], done.stderr[-2000:])
    return base / "out"


def _findings(folder: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "vigil", "analyze", str(folder), "--json", "--no-progress"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    return list(json.loads(done.stdout)["findings"])


def _named(findings: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    return sorted((f["kind"], f["subjects"].get("ranks", [])) for f in findings)


def test_a_rank_that_left_its_loop_early_is_the_crashs_culprit(outputs: Path) -> None:
    found = _findings(outputs / "uneven-exit")
    assert _named(found) == [("crash", [3])], [f["summary"] for f in found]
    assert "finished early" in found[0]["summary"]


def test_a_barrier_meeting_an_all_reduce_is_a_desync_naming_the_rank_at_the_barrier(
    outputs: Path,
) -> None:
    found = _findings(outputs / "uneven-barrier")
    assert _named(found) == [("crash", [3]), ("hang", [3])], [f["summary"] for f in found]
    hang = next(f for f in found if f["kind"] == "hang")
    assert "desync" in hang["summary"] and "rank(s) 3 entered barrier" in hang["summary"]
    # Found well before the 15 s timeout ended the job.
    silent = next(e for e in hang["evidence"] if e["metric"] == "seconds_without_progress")
    assert silent["observed"] < 10.0


def test_a_rank_stuck_for_good_is_named_by_the_hang_and_by_the_crash_it_ends_in(
    outputs: Path,
) -> None:
    found = _findings(outputs / "uneven-stuck")
    assert _named(found) == [("crash", [2]), ("hang", [2])], [f["summary"] for f in found]
    crash = next(f for f in found if f["kind"] == "crash")
    assert "hung, and its peers failed waiting for it" in crash["summary"]
