"""The `vigil` entry point: subcommand discovery, version, logging and bad environment."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from vigil import __version__, cli, schema


def test_version_command_prints_version_and_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"vigil {__version__} (wire schema v{schema.SCHEMA_VERSION})")


def test_verbose_version_lists_dependencies(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["version", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "msgspec " in out


def test_a_named_command_loads_only_its_own_subsystem() -> None:
    code = (
        "import sys\n"
        "from vigil import cli\n"
        "assert cli.main(['version']) == 0\n"
        "heavy = {'torch', 'fastapi', 'sqlalchemy'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_option_values_are_not_taken_for_the_command() -> None:
    assert cli._requested(["--log-level", "DEBUG", "version", "-v"]) == "version"
    assert cli._requested(["--help"]) is None


def test_commands_are_discovered_from_entry_points() -> None:
    commands, errors = cli.discover_commands()
    assert "version" in {c.name for c in commands}
    assert errors == []


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_bad_environment_is_a_clear_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VIGIL_LOG_LEVEL", "LOUD")
    with pytest.raises(SystemExit) as info:
        cli.main(["version"])
    assert info.value.code == 2
    assert "LOUD" in capsys.readouterr().err


def test_command_names_are_validated() -> None:
    with pytest.raises(ValueError, match="alphanumeric"):
        cli.Command(name="bad name", help="", configure=lambda p: None, run=lambda a: 0)


def test_parser_runs_a_registered_command() -> None:
    seen: list[argparse.Namespace] = []

    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 7

    parser = cli.build_parser([cli.Command(name="x", help="x", configure=configure, run=run)])
    args = parser.parse_args(["x", "--n", "3"])
    assert args._run(args) == 7 and seen[0].n == 3


def test_console_script_and_module_entry_point() -> None:
    for argv in (["vigil", "version"], [sys.executable, "-m", "vigil", "version"]):
        exe = argv if argv[0] != "vigil" else [str(_venv_bin("vigil")), *argv[1:]]
        done = subprocess.run(exe, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"vigil {__version__}")


def test_importing_vigil_has_no_side_effects() -> None:
    code = (
        "import logging, threading, sys\n"
        "import vigil, vigil.schema, vigil.codec, vigil.settings, vigil.cli, vigil.env\n"
        "assert 'torch' not in sys.modules, 'importing the core must not import torch'\n"
        "import vigil.agent, vigil.collector, vigil.analyzer, vigil.recovery, vigil.trainer,"
        " vigil.kernels\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert not logging.getLogger().handlers and not logging.getLogger('vigil').handlers\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _venv_bin(name: str) -> object:
    from pathlib import Path

    return Path(sys.executable).parent / name
