"""The `vigil` command line: one entry point, subcommands discovered through entry points.

Each subsystem publishes its subcommands in the `vigil.commands` entry-point group (see
pyproject.toml) as a `Command`; the core never imports the subsystems directly. Logging is
configured here, once, and nowhere else. The argparse types and checks the subcommands share
(counts, collector URLs, writable folders, per-run job names) live here too, so every command
refuses bad input with the same kind of one-line message.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import logging
import math
import secrets
import sys
import tempfile
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from vigil import _version, logs, schema, settings

ENTRY_POINT_GROUP = "vigil.commands"
log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Command:
    """One `vigil <name>` subcommand: how to declare its arguments and how to run it."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum():
            raise ValueError(f"command name {self.name!r} must be alphanumeric (dashes allowed)")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: `vigil run: error: argument --nproc: ...`, exit 2.

    The usage block argparse prints first is left out: for commands with many options it buries
    the one line that says what was wrong; `--help` shows it.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def discover_commands(only: str | None = None) -> tuple[list[Command], list[str]]:
    """Load published subcommands (just `only`, when given and published); return them and the
    errors of those that failed. Loading one keeps `vigil <cmd>` from importing every subsystem.
    """
    commands: dict[str, Command] = {}
    errors: list[str] = []
    eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    if only is not None and any(ep.name == only for ep in eps):
        eps = [ep for ep in eps if ep.name == only]
    for ep in eps:
        try:
            command = ep.load()
        except Exception as exc:  # a broken optional subsystem must not take the CLI down
            errors.append(f"vigil {ep.name}: unavailable ({type(exc).__name__}: {exc})")
            continue
        if not isinstance(command, Command) or command.name != ep.name:
            errors.append(
                f"vigil {ep.name}: entry point {ep.value} is not a vigil Command named so"
            )
            continue
        commands.setdefault(command.name, command)
    return sorted(commands.values(), key=lambda c: c.name), errors


def build_parser(commands: Sequence[Command]) -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vigil",
        description="Profiling, monitoring and fault recovery for distributed PyTorch training.",
    )
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (env VIGIL_LOG_LEVEL)")
    parser.add_argument(
        "--log-format", choices=[f.value for f in settings.LogFormat], help="plain or json"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for command in commands:
        sub_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub_parser)
        sub_parser.set_defaults(_run=command.run)
    return parser


def _requested(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option)."""
    words = iter(argv)
    for word in words:
        if word in ("--log-level", "--log-format"):
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands, errors = discover_commands(only=_requested(argv))
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    try:
        common = settings.CommonSettings()
    except ValueError as exc:
        parser.error(f"bad VIGIL_* environment: {exc}")
    logs.configure(
        args.log_level.upper() if args.log_level else common.log_level,
        settings.LogFormat(args.log_format) if args.log_format else common.log_format,
    )
    for error in errors:
        log.warning("%s", error)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args))
    except KeyboardInterrupt:
        return 130


# -- argument types and checks shared by the subcommands ------------------------------------
# argparse reports an ArgumentTypeError as "argument --opt: <message>" and exits 2.


def _number(text: str, convert: Callable[[str], float], kind: str) -> float:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}")
    return value


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1 (ranks, steps, sizes)."""
    value = int(_number(text, int, "a positive integer"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type for counts where 0 means none or "the default" (spares, restarts)."""
    value = int(_number(text, int, "an integer >= 0"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type for finite quantities above 0 (timeouts, learning rates)."""
    value = _number(text, float, "a positive number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type for finite quantities of at least 0 (cool-downs)."""
    value = _number(text, float, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def url_problem(url: str) -> str:
    """Why `url` is not an http(s) URL naming a host and a usable port; "" when it is one."""
    if not url or any(c.isspace() for c in url):
        return "it is empty or contains whitespace"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises for a port out of 0-65535 or not a number
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "it must start with http:// or https://"
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "port 0 is not a port anything listens on"
    return ""


def collector_url(text: str) -> str:
    """argparse type for `--collector URL`: http(s), a host, and a port in 1-65535 if given."""
    problem = url_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} is not a collector URL: {problem}")
    return text


def ensure_writable_dir(path: Path) -> None:
    """Create `path` if needed and check a file can be made in it; ValueError says why not."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{path} is not a writable directory ({exc.strerror or exc})") from exc


def unique_job_name(prefix: str, *, now: datetime.datetime | None = None) -> str:
    """`<prefix>-<UTC time>-<6 hex digits>`: a fresh job name per run, so runs never share one.

    The time sorts runs and says when each started; the random part tells apart runs started in
    the same second.
    """
    moment = now or datetime.datetime.now(datetime.UTC)
    return f"{prefix}-{moment.strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"


def _configure_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="also list the versions of key dependencies"
    )


def _run_version(args: argparse.Namespace) -> int:
    out = sys.stdout
    out.write(f"vigil {_version.__version__} (wire schema v{schema.SCHEMA_VERSION})\n")
    if args.verbose:
        out.write(f"python {sys.version.split()[0]}\n")
        for dist in ("torch", "msgspec", "fastapi", "sqlalchemy", "prometheus-client"):
            try:
                out.write(f"{dist} {importlib.metadata.version(dist)}\n")
            except importlib.metadata.PackageNotFoundError:
                out.write(f"{dist} (not installed)\n")
    return 0


version_command = Command(
    name="version",
    help="print vigil's version and wire schema version",
    configure=_configure_version,
    run=_run_version,
)
