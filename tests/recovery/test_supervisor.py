"""`vigil run` end to end: real processes, real gloo, crashes, migration, resize, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from vigil import codec
from vigil.env import EnvVar
from vigil.recovery.controller import crash_finding_id
from vigil.schema import Action, ActionKind, ActionState

HERE = Path(__file__).parent
VIGIL = [sys.executable, "-m", "vigil"]


def run_vigil(
    args: list[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    if "--run-dir" in args:  # the job's record (controller.jsonl) beside the run dir, in tmp
        run_dir = Path(args[args.index("--run-dir") + 1])
        env = {EnvVar.OUTPUT_DIR.value: str(run_dir.parent / "out"), **env}
    return subprocess.run(
        [*VIGIL, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def final_actions(run_dir: Path) -> dict[str, Action]:
    actions: dict[str, Action] = {}
    for line in (run_dir / "actions.jsonl").read_bytes().splitlines():
        record = codec.decode_json(line)
        assert isinstance(record, Action)
        actions[record.action_id] = record
    return actions


def progress(toy: Path, rank: int) -> list[list[str]]:
    return [ln.split() for ln in (toy / f"progress-rank{rank}.txt").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_gloo_job_recovers_from_repeated_crashes_by_restart_then_migration(tmp_path: Path) -> None:
    """Rank 1 dies at step 2 (attempt 0) and step 4 (attempt 1): restart, then move node-0.

    Persistent checkpoints come every 3 steps, snapshots every step: both recoveries resume from
    the step that was lost, the second from the replicas node-1 holds (node-0's memory is gone).
    """
    toy, run_dir, shm = tmp_path / "toy", tmp_path / "run", tmp_path / "shm"
    toy.mkdir()
    done = run_vigil(
        [
            "run",
            "--nproc",
            "4",
            "--nodes",
            "2",
            "--spare",
            "1",
            "--run-dir",
            str(run_dir),
            "--job",
            "toy",
            "--snapshot-dir",
            str(shm),
            "--",
            sys.executable,
            str(HERE / "toy_job.py"),
        ],
        {"TOY_DIR": str(toy), "TOY_STEPS": "7", "TOY_CRASH": "0:1:2,1:1:4"},
    )
    assert done.returncode == 0, done.stderr
    actions = final_actions(run_dir)
    assert {(a.finding_id, a.kind, a.state) for a in actions.values()} == {
        (crash_finding_id("toy", 0, 1), ActionKind.RESTART, ActionState.SUCCEEDED),
        (crash_finding_id("toy", 1, 1), ActionKind.MIGRATE, ActionState.SUCCEEDED),
    }
    # Each restart names the attempt it launched; the job's record keeps them for vigil analyze.
    assert sorted((a.attempt, a.kind) for a in actions.values()) == [
        (1, ActionKind.RESTART),
        (2, ActionKind.MIGRATE),
    ]
    record = [
        codec.decode_json(ln)
        for ln in (tmp_path / "out" / "toy" / "controller.jsonl").read_bytes().splitlines()
    ]
    assert [r.kind for r in record if not isinstance(r, Action)] == ["crash", "crash"]
    migrate = next(a for a in actions.values() if a.kind is ActionKind.MIGRATE)
    assert migrate.target == "node-0" and "node-2,node-1" in migrate.result
    rows = progress(toy, 1)
    # Every step 0..6 completed exactly once, resuming where the checkpoint left off.
    completed = [int(r[1]) for r in rows if r[2] != "crash"]
    assert completed == list(range(7))
    # After the migration rank 1 ran on the spare node.
    assert {r[2] for r in rows if r[0] == "2" and r[2] != "crash"} == {"node-2"}
    resumes = (toy / "resume-rank1.txt").read_text().split("\n")
    assert resumes[:3] == ["0 scratch 0", "1 snapshot 2", "2 replica 4"]
    # The weights equal an uninterrupted run's: no step was lost or repeated.
    import torch

    final = torch.load(toy / "final.pt")["weight"]
    assert torch.allclose(final, torch.full((4,), -0.01 * 10 / 4 * 7))
    assert not (shm / "toy").exists(), "a finished job's snapshots are freed"


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_without_spares_the_job_shrinks_data_parallel(tmp_path: Path) -> None:
    toy, run_dir = tmp_path / "toy", tmp_path / "run"
    toy.mkdir()
    done = run_vigil(
        [
            "run",
            "--nproc",
            "4",
            "--nodes",
            "2",
            "--run-dir",
            str(run_dir),
            "--",
            sys.executable,
            str(HERE / "file_job.py"),
        ],
        {"TOY_DIR": str(toy), "TOY_STEPS": "6", "TOY_CRASH": "0:3:1,1:3:3"},
    )
    assert done.returncode == 0, done.stderr
    kinds = {a.kind: a for a in final_actions(run_dir).values()}
    assert kinds[ActionKind.RESIZE].target == "node-1"
    assert "world size 2" in kinds[ActionKind.RESIZE].result
    state = msgspec.json.decode((run_dir / "state.json").read_bytes())
    assert state["active"] == ["node-0"] and state["cordoned"] == ["node-1"]


@pytest.mark.e2e
def test_restart_budget_ends_a_crash_loop(tmp_path: Path) -> None:
    toy, run_dir = tmp_path / "toy", tmp_path / "run"
    toy.mkdir()
    crash_always = ",".join(f"{a}:0:0" for a in range(5))
    done = run_vigil(
        [
            "run",
            "--nproc",
            "2",
            "--max-restarts",
            "2",
            "--run-dir",
            str(run_dir),
            "--",
            sys.executable,
            str(HERE / "file_job.py"),
        ],
        {"TOY_DIR": str(toy), "TOY_CRASH": crash_always},
    )
    assert done.returncode == 1
    restarts = [a for a in final_actions(run_dir).values() if a.kind is ActionKind.RESTART]
    assert len(restarts) == 2
    assert "max restarts (2) reached" in done.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nproc", "3", "--nodes", "2", "--", "true"], "multiple of --nodes"),
        (["--nproc", "2"], "after `--`"),
    ],
)
def test_bad_arguments_are_explained(tmp_path: Path, args: list[str], needle: str) -> None:
    done = run_vigil(["run", "--run-dir", str(tmp_path / "r"), *args], {})
    assert done.returncode == 2 and needle in done.stderr


def test_a_finished_run_dir_is_not_reused(tmp_path: Path) -> None:
    toy = tmp_path / "toy"
    toy.mkdir()
    args = [
        "run",
        "--nproc",
        "1",
        "--run-dir",
        str(tmp_path / "r"),
        "--",
        sys.executable,
        str(HERE / "file_job.py"),
    ]
    assert run_vigil(args, {"TOY_DIR": str(toy), "TOY_STEPS": "1"}).returncode == 0
    again = run_vigil(args, {"TOY_DIR": str(toy)})
    assert again.returncode == 2 and "finished run" in again.stderr
