"""The `vigil` entry point: subcommand discovery, version, logging and bad environment."""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
from pathlib import Path

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
    return Path(sys.executable).parent / name


# -- the argument types and checks the subcommands share ------------------------------------


def _parse_error(type_: object, value: str, capsys: pytest.CaptureFixture[str]) -> str:
    parser = cli.ArgumentParser(prog="vigil x")
    parser.add_argument("--n", type=type_)  # type: ignore[call-overload]
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--n", value])
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("type_", "value", "needle"),
    [
        (cli.positive_int, "0", "must be a positive integer, got '0'"),
        (cli.positive_int, "-3", "must be a positive integer, got '-3'"),
        (cli.positive_int, "two", "'two' is not a positive integer"),
        (cli.positive_int, "1.5", "'1.5' is not a positive integer"),
        (cli.non_negative_int, "-1", "must be an integer >= 0, got '-1'"),
        (cli.positive_float, "0", "must be a number > 0, got '0'"),
        (cli.positive_float, "nan", "'nan' is not a positive number"),
        (cli.non_negative_float, "-0.5", "must be a number >= 0, got '-0.5'"),
        (cli.non_negative_float, "inf", "'inf' is not a number >= 0"),
    ],
)
def test_out_of_range_numbers_are_one_line_usage_errors(
    type_: object, value: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _parse_error(type_, value, capsys)
    assert err == f"vigil x: error: argument --n: {needle} (see vigil x --help)\n"


def test_numbers_in_range_pass() -> None:
    assert cli.positive_int("1") == 1 and cli.non_negative_int("0") == 0
    assert cli.positive_float("0.5") == 0.5 and cli.non_negative_float("0") == 0.0


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("notaurl", "must start with http:// or https://"),
        ("ftp://collector:8470", "must start with http:// or https://"),
        ("http://collector:99999", "Port out of range"),
        ("http://collector:-1", "Port could not be cast"),
        ("http://collector:port", "Port could not be cast"),
        ("http://collector:0", "port 0"),
        ("http://:8470", "names no host"),
        ("http:///ingest", "names no host"),
        ("http://col lector:8470", "whitespace"),
        ("", "empty"),
    ],
)
def test_bad_collector_urls_say_what_is_wrong(url: str, problem: str) -> None:
    assert problem in cli.url_problem(url)
    with pytest.raises(argparse.ArgumentTypeError, match=f"{url!r} is not a collector URL"):
        cli.collector_url(url)


@pytest.mark.parametrize(
    "url", ["http://collector:8470", "https://collector", "http://[::1]:8470/", "http://10.0.0.1"]
)
def test_good_collector_urls_pass(url: str) -> None:
    assert cli.url_problem(url) == "" and cli.collector_url(url) == url


@pytest.mark.parametrize("command", ["agent", "train", "diag"])
@pytest.mark.parametrize("url", ["notaurl", "http://collector:99999"])
def test_every_collector_option_refuses_a_bad_url_in_one_line(
    command: str, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--collector", url])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vigil {command}: error: argument --collector: {url!r} is not a")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_agent_refuses_a_bad_collector_url_from_its_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VIGIL_COLLECTOR_URL", "http://collector:99999")
    assert cli.main(["agent", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "VIGIL_COLLECTOR_URL='http://collector:99999'" in err and "Port out of range" in err


def test_writable_dirs_are_created_and_unusable_ones_explained(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b"
    cli.ensure_writable_dir(nested)
    assert nested.is_dir() and list(nested.iterdir()) == []  # the probe file leaves nothing
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        cli.ensure_writable_dir(afile)
    with pytest.raises(ValueError, match="is not a writable directory"):
        cli.ensure_writable_dir(afile / "sub")


def test_unique_job_names_differ_even_within_one_second() -> None:
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    names = {cli.unique_job_name("vigil-train", now=moment) for _ in range(50)}
    assert len(names) == 50
    assert all(re.fullmatch(r"vigil-train-20260102T030405Z-[0-9a-f]{6}", n) for n in names)
