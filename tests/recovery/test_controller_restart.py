"""Kill the controller at each stage of a recovery, start it again: it recovers exactly once.

The job is tests/recovery/file_job.py (no torch, so 20 runs stay quick); the controller is the
real `vigil run` process, killed by its own crash-injection hook (VIGIL_CONTROLLER_DIE_AT).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vigil import codec
from vigil.env import EnvVar
from vigil.recovery.controller import STAGES, crash_finding_id
from vigil.schema import Action, ActionState

HERE = Path(__file__).parent
RUNS_PER_STAGE = 4  # 5 stages x 4 = 20 runs


def vigil_run(run_dir: Path, toy: Path, die_at: str | None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TOY_DIR": str(toy),
        "TOY_STEPS": "8",
        "TOY_STEP_S": "0.03",
        "TOY_CRASH": "0:1:3",
    }
    env[EnvVar.OUTPUT_DIR.value] = str(run_dir.parent / "out")  # the job's record stays in tmp
    env.pop(EnvVar.CONTROLLER_DIE_AT, None)
    if die_at:
        env[EnvVar.CONTROLLER_DIE_AT] = die_at
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "vigil",
            "run",
            "--nproc",
            "2",
            "--nodes",
            "2",
            "--spare",
            "1",
            "--run-dir",
            str(run_dir),
            "--job",
            "toy",
            "--",
            sys.executable,
            str(HERE / "file_job.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_controller_killed_mid_recovery_finishes_it_exactly_once(
    tmp_path: Path, stage: str
) -> None:
    for run in range(RUNS_PER_STAGE):
        toy, run_dir = tmp_path / f"toy{run}", tmp_path / f"run{run}"
        toy.mkdir()
        first = vigil_run(run_dir, toy, die_at=stage)
        assert first.returncode == 70, first.stderr  # died where we asked
        second = vigil_run(run_dir, toy, die_at=None)
        assert second.returncode == 0, second.stderr
        lines = [
            codec.decode_json(ln) for ln in (run_dir / "actions.jsonl").read_bytes().splitlines()
        ]
        actions = [a for a in lines if isinstance(a, Action)]
        assert {a.action_id for a in actions} == {f"{crash_finding_id('toy', 0, 1)}/0-restart"}
        assert [a.state for a in actions].count(ActionState.SUCCEEDED) == 1
        # Exactly one restart: attempts 0 and 1 only, and every step ran once on each rank.
        attempts = sorted(p.name for p in (run_dir / "attempts").iterdir())
        assert attempts == ["attempt-0", "attempt-1"]
        for rank in (0, 1):
            rows = (toy / f"progress-rank{rank}.txt").read_text().split("\n")
            steps = [int(r.split()[1]) for r in rows if r and not r.endswith("crash")]
            assert steps == list(range(8)), (stage, run, rank, rows)
