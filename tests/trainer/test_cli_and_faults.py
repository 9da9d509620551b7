"""`vigil train` end to end with injected faults (real 2-rank gloo jobs), and bad flags failing at
start with a message that says what to change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer import workers
from vigil import cli
from vigil.trainer import checkpoint, faults, recipes
from vigil.trainer.exits import ExitCode

LOSS_ATOL = 2e-4


def _vigil_train(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "vigil", "train", "--no-telemetry", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "tp=3 must divide n_heads"),
        (["--dp", "2", "--dp-mode", "ddp", "--tp", "2"], "use data_parallel='fsdp'"),
        (["--pp", "4"], "4 pipeline stages need at least that many layers"),
        (["--dp", "3"], "global_batch (8) must be divisible by the data-parallel size (3)"),
        (["--micro-batch", "3"], "micro_batch (3) must divide the per-rank batch (8)"),
        (["--faults", "explode:rank=0"], "unknown fault kind 'explode'"),
    ],
)
def test_bad_recipes_fail_at_start_with_what_to_change(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["train", "--no-telemetry", *argv]) == ExitCode.BAD_CONFIG
    assert message in capsys.readouterr().err


def test_world_size_not_matching_the_mesh_fails_before_any_rendezvous(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: a rendezvous attempt would fail
    assert cli.main(["train", "--no-telemetry", "--tp", "2"]) == ExitCode.BAD_CONFIG
    err = capsys.readouterr().err
    assert "world size 3 does not match" in err and "launch 2 processes" in err


def _metrics(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_injected_crash_then_restart_resumes_and_matches_the_reference(tmp_path: Path) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    common = ["--nproc", "2", "--dp", "2", "--steps", "8", "--ckpt-dir", str(ckpt)]
    common += ["--ckpt-every", "2", "--metrics-out", str(metrics)]
    first = _vigil_train(*common, env={"VIGIL_FAULTS": "crash:rank=1,step=5"})
    assert first.returncode == faults.CRASH_EXIT_CODE, first.stderr[-2000:]
    assert "injected crash: rank 1 exits at step 5" in first.stderr
    assert f"rank 1 exited with {faults.CRASH_EXIT_CODE}" in first.stderr
    # Step 4's async save may still be in flight when rank 1 dies, and then never commits.
    resume_step = checkpoint.committed_steps(ckpt)[-1]
    assert resume_step in (2, 4)
    # The supervisor's second attempt: the fault belongs to attempt 0 and does not fire again.
    second = _vigil_train(
        *common, env={"VIGIL_FAULTS": "crash:rank=1,step=5", "VIGIL_RESTART_COUNT": "1"}
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"(step {resume_step})" in second.stderr
    losses = _metrics(metrics)
    assert sorted(losses) == list(range(1, 9))
    reference = workers.reference_losses(recipes.named("tiny", steps=8)).losses
    for step, value in losses.items():
        assert value == pytest.approx(reference[step], abs=LOSS_ATOL), step


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_hang_inside_a_collective_blocks_the_job_until_the_collective_timeout() -> None:
    start = time.monotonic()
    done = _vigil_train(
        "--nproc", "2", "--dp", "2", "--steps", "6", "--timeout", "6",
        "--faults", "hang:rank=1,step=3,where=collective",
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert done.returncode == ExitCode.FAILED, done.stderr[-2000:]
    assert "injected hang (collective) on rank 1 at step 3" in done.stderr
    assert "step 3 loss" not in done.stderr  # nobody finished the step
    assert elapsed >= 6.0
