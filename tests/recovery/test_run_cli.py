"""`vigil run` refusing what cannot work: counts out of range, a command that cannot run (up
front, and exit 126/127 from a rank, never retried), and a fresh job name per run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vigil import cli, codec
from vigil.recovery import controller, local
from vigil.schema import Action, ActionKind

VIGIL = [sys.executable, "-m", "vigil"]


def run_vigil(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*VIGIL, *args],
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def restarts(run_dir: Path) -> list[Action]:
    journal = run_dir / "actions.jsonl"
    lines = journal.read_bytes().splitlines() if journal.exists() else []
    records = [codec.decode_json(line) for line in lines]
    return [r for r in records if isinstance(r, Action) and r.kind is ActionKind.RESTART]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nproc", "0"], "argument --nproc: must be a positive integer, got '0'"),
        (["--nproc", "-2"], "argument --nproc: must be a positive integer, got '-2'"),
        (["--nproc", "2", "--nodes", "0"], "argument --nodes: must be a positive integer"),
        (["--nproc", "2", "--spare", "-1"], "argument --spare: must be an integer >= 0"),
        (["--nproc", "2", "--max-restarts", "-1"], "argument --max-restarts: must be an integer"),
        (["--nproc", "2", "--min-dp", "0"], "argument --min-dp: must be a positive integer"),
        (["--nproc", "2", "--cooldown", "-5"], "argument --cooldown: must be a number >= 0"),
    ],
)
def test_counts_out_of_range_are_refused(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--run-dir", str(tmp_path / "r"), *args, "--", "true"])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _not_executable(tmp_path: Path) -> str:
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")
    script.chmod(0o644)
    return str(script)


@pytest.mark.parametrize(
    ("program", "needle"),
    [
        (lambda _: "/nonexistent", "the command /nonexistent does not exist"),
        (lambda _: "no-such-trainer", "'no-such-trainer' was not found on PATH"),
        (_not_executable, "train.sh is not executable"),
        (lambda tmp: str(tmp), "is a directory"),
    ],
)
def test_a_command_that_cannot_run_is_refused_before_anything_starts(
    program: object, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = program(tmp_path)  # type: ignore[operator]
    run_dir = tmp_path / "r"
    assert cli.main(["run", "--nproc", "2", "--run-dir", str(run_dir), "--", command]) == 2
    assert needle in capsys.readouterr().err
    assert not run_dir.exists()  # no journal, no attempt was launched


def test_the_executor_checks_its_command_on_its_own_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'vigil-test-tool' was not found on PATH"):
        local.LocalExecutor(command=["vigil-test-tool"], run_dir=tmp_path)
    tool = tmp_path / "vigil-test-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    local.LocalExecutor(command=["vigil-test-tool"], run_dir=tmp_path, env={"PATH": str(tmp_path)})


def test_the_executor_reports_unrunnable_as_what_the_controller_stops_on() -> None:
    assert local.BAD_CONFIG_EXIT == controller.BAD_CONFIG_EXIT


@pytest.mark.parametrize(
    ("code", "why"),
    [(127, "its command was not found"), (126, "its command could not be executed")],
)
def test_a_rank_exiting_126_or_127_stops_the_job_without_restarts(
    code: int, why: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "r"
    done = run_vigil(
        ["run", "--nproc", "2", "--max-restarts", "3", "--run-dir", str(run_dir), "--",
         "sh", "-c", f"echo 'trainer: missing' >&2; exit {code}"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"exited {code}: {why} (trainer: missing)" in done.stderr
    assert "restarting cannot help" in done.stderr and "failed (exit 2)" in done.stderr
    assert restarts(run_dir) == []


def test_runs_without_job_get_fresh_names_that_reach_the_ranks(tmp_path: Path) -> None:
    seen = tmp_path / "jobs.txt"
    command = ["--", "sh", "-c", f'echo "$VIGIL_JOB" >> {seen}']
    first = run_vigil(["run", "--nproc", "1", *command], tmp_path)
    second = run_vigil(["run", "--nproc", "1", *command], tmp_path)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    printed = [re.search(r"vigil run: job (\S+);", d.stderr) for d in (first, second)]
    names = [m.group(1) for m in printed if m]
    assert len(set(names)) == 2 and all(n.startswith("vigil-run-") for n in names)
    assert seen.read_text().split() == names  # what each run's ranks were told
    assert sorted(p.name for p in (tmp_path / "vigil-runs").iterdir()) == sorted(names)


def test_an_explicit_job_name_is_kept(tmp_path: Path) -> None:
    seen = tmp_path / "jobs.txt"
    done = run_vigil(
        ["run", "--nproc", "1", "--job", "mine", "--", "sh", "-c", f'echo "$VIGIL_JOB" > {seen}'],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert seen.read_text().strip() == "mine" and (tmp_path / "vigil-runs" / "mine").is_dir()
