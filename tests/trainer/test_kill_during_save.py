"""Killing the job while an async checkpoint is being written never leaves a resumable partial.

A real `python -m vigil.trainer` process saves every step; the test SIGKILLs it a few
milliseconds after a save starts, 10 times in a row, and each restart must resume from the
newest committed checkpoint — never from the half-written one the kill left behind.
"""

from __future__ import annotations

import os
import random
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vigil.trainer import checkpoint

KILLS = 10
_SAVE_STARTED = re.compile(r"checkpoint step (\d+): save started")
_RESUMED = re.compile(r"resumed from .*step-\d+ \(step (\d+)\)")


def _command(ckpt: Path) -> list[str]:
    # ~3M parameters: each save writes ~40 MB, long enough for a kill to land inside it.
    return [
        sys.executable, "-m", "vigil.trainer", "--steps", "500", "--dim", "256", "--layers", "4",
        "--ckpt-dir", str(ckpt), "--ckpt-every", "1", "--keep-last", "2", "--no-telemetry",
        "--cpu-threads", "1",
    ]  # fmt: skip


def _run_until_save(ckpt: Path, rng: random.Random) -> tuple[int | None, int]:
    """Start the trainer; kill it just after its second new save starts. (resumed, killed)."""
    env = {**os.environ, "VIGIL_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(_command(ckpt), stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stderr, selectors.EVENT_READ)
    resumed, saves, deadline = None, 0, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if not selector.select(timeout=1.0):
                continue
            line = proc.stderr.readline()
            if not line:
                raise AssertionError(f"trainer exited early with {proc.wait(timeout=5)}")
            if match := _RESUMED.search(line):
                resumed = int(match.group(1))
            if match := _SAVE_STARTED.search(line):
                saves += 1
                if saves == 2:
                    time.sleep(rng.uniform(0.0, 0.05))
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(timeout=10)
                    return resumed, int(match.group(1))
        raise AssertionError("the trainer did not reach its second save within 60s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        selector.close()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_kill_during_async_save_always_resumes_from_newest_committed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rng = random.Random(7)
    expected_resume: int | None = None
    partial_kills = 0
    for attempt in range(KILLS):
        resumed, killed_step = _run_until_save(ckpt, rng)
        assert resumed == expected_resume, f"attempt {attempt}: resumed from {resumed}"
        killed_dir = checkpoint.step_dir(ckpt, killed_step)
        if killed_dir.exists() and not (killed_dir / checkpoint.COMMIT_MARKER).exists():
            partial_kills += 1
        newest = checkpoint.latest_committed(ckpt)
        assert newest is not None and checkpoint.verify(newest)
        expected_resume = int(newest.name.split("-")[1])
        assert expected_resume >= killed_step - 1  # the save before the killed one committed
    # The kills really landed inside saves (else this test would prove nothing).
    assert partial_kills >= 3, f"only {partial_kills} of {KILLS} kills hit a save in flight"


def test_a_corrupted_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    for step in (1, 2):
        path = checkpoint.step_dir(tmp_path, step)
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(bytes([step]) * 1000)
        checkpoint.commit(path, step=step)
    partial = checkpoint.step_dir(tmp_path, 3)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")  # never committed
    assert checkpoint.latest_committed(tmp_path) == checkpoint.step_dir(tmp_path, 2)
    data = checkpoint.step_dir(tmp_path, 2) / "__0_0.distcp"
    data.write_bytes(b"\x00" + data.read_bytes()[1:])  # same size, one byte flipped
    assert checkpoint.latest_committed(tmp_path) == checkpoint.step_dir(tmp_path, 1)
    removed = checkpoint.prune(tmp_path, keep_last=1)
    assert checkpoint.step_dir(tmp_path, 1) in removed
    assert partial.exists()  # newer than every commit: maybe still being written
