"""`vigil train` refusing what cannot work before any training (counts below their minimum, a
checkpoint folder that cannot take files) and naming each run's job afresh unless told."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vigil import cli
from vigil.trainer import cli as train_cli
from vigil.trainer.exits import ExitCode


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nproc", "0"], "argument --nproc: must be a positive integer, got '0'"),
        (["--nproc", "-1"], "argument --nproc: must be a positive integer, got '-1'"),
        (["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
        (["--dp", "0"], "argument --dp: must be a positive integer"),
        (["--tp", "-2"], "argument --tp: must be a positive integer"),
        (["--layers", "0"], "argument --layers: must be a positive integer"),
        (["--global-batch", "0"], "argument --global-batch: must be a positive integer"),
        (["--keep-last", "0"], "argument --keep-last: must be a positive integer"),
        (["--cpu-threads", "0"], "argument --cpu-threads: must be a positive integer"),
        (["--ckpt-every", "-1"], "argument --ckpt-every: must be an integer >= 0"),
        (["--timeout", "0"], "argument --timeout: must be a number > 0"),
        (["--lr", "-0.1"], "argument --lr: must be a number > 0"),
    ],
)
def test_counts_below_their_minimum_are_refused(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--no-telemetry", *args])
    assert info.value.code == ExitCode.BAD_CONFIG
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2", "--dp", "2"]])
@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_an_unusable_ckpt_dir_fails_before_any_training(
    nproc: list[str], where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "a_file"
    afile.write_text("not a folder")
    ckpt = afile if where == "a_file" else afile / "ckpt"
    metrics = tmp_path / "steps.jsonl"
    argv = ["train", "--no-telemetry", "--steps", "50", "--ckpt-dir", str(ckpt)]
    argv += ["--metrics-out", str(metrics), *nproc]
    assert cli.main(argv) == ExitCode.BAD_CONFIG
    assert f"vigil train: --ckpt-dir: {ckpt}" in capsys.readouterr().err
    assert not metrics.exists()  # not one step ran


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    return parser.parse_args(list(argv))


def test_job_names_without_job_are_fresh_per_run_and_shared_by_ranks() -> None:
    single = [train_cli.job_name(_args(), {}) for _ in range(3)]
    assert len(set(single)) == 3
    assert all(re.fullmatch(r"vigil-train-\d{8}T\d{6}Z-[0-9a-f]{6}", n) for n in single)
    assert train_cli.job_name(_args("--job", "mine"), {"VIGIL_JOB": "theirs"}) == "mine"
    # `vigil run` tells every rank its job; torchrun tells them its rendezvous id.
    launched = {"WORLD_SIZE": "4", "RANK": "2"}
    assert train_cli.job_name(_args(), {**launched, "VIGIL_JOB": "run-7"}) == "run-7"
    run_id = {**launched, "TORCHELASTIC_RUN_ID": "4f2a"}
    assert train_cli.job_name(_args(), run_id) == "vigil-train-4f2a"
    with pytest.raises(ValueError, match="4 ranks of this launch need one job name"):
        train_cli.job_name(_args(), {**launched, "TORCHELASTIC_RUN_ID": "none"})
    assert train_cli.job_name(_args("--no-telemetry"), launched).startswith("vigil-train-")


def test_ranks_of_a_launcher_without_a_shared_name_fail_before_rendezvous(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: a rendezvous attempt would fail
    monkeypatch.delenv("VIGIL_JOB", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert cli.main(["train", "--dp", "2"]) == ExitCode.BAD_CONFIG
    assert "pass --job NAME" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_two_runs_without_job_keep_their_steps_apart(tmp_path: Path) -> None:
    out = tmp_path / "sdk"

    def train(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "vigil", "train", "--steps", "2", "--output-dir", str(out),
             "--cpu-threads", "1", *args],
            env={k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")},
            capture_output=True, text=True, timeout=150, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        printed = re.findall(r"vigil train: job (\S+)", done.stderr)
        assert len(printed) == 1, done.stderr[-2000:]  # the launcher says it, its ranks do not
        return printed[0]

    first = train("--nproc", "2", "--dp", "2")
    second = train()
    assert first != second
    assert sorted(p.name for p in out.iterdir()) == sorted([first, second])
    # The launcher handed its name to both ranks: one job, two ranks, each with its steps.
    ranks = sorted(p.name for p in (out / first).iterdir())
    assert ranks == ["rank-00000.jsonl", "rank-00001.jsonl"]
    for job in (first, second):
        assert '"type":"step"' in (out / job / "rank-00000.jsonl").read_text()
