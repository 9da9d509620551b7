"""The `vigil` command line: one entry point, subcommands discovered through entry points.

Each subsystem publishes its subcommands in the `vigil.commands` entry-point group (see
pyproject.toml) as a `Command`; the core never imports the subsystems directly. Logging is
configured here, once, and nowhere else.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    parser = argparse.ArgumentParser(
        prog="vigil",
        description="Profiling, monitoring and fault recovery for distributed PyTorch training.",
    )
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (env VIGIL_LOG_LEVEL)")
    parser.add_argument(
        "--log-format", choices=[f.value for f in settings.LogFormat], help="plain or json"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
