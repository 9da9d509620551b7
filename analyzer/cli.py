"""The `vigil analyze PATH` subcommand (published through the `vigil.commands` entry points).

Uses only the standard library, rich (progress bar) and vigil core around the pure analyzer.
Exit status: 0 when something was analysed (inputs that could not be read are named in a
warning), 1 when nothing could be (each input named with its error), 2 when PATH does not exist
or holds no file vigil reads (the message says what was searched for).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from vigil import cli as core_cli
from vigil.analyzer import offline, report

# Inputs above this size (bytes) get a progress bar on a terminal: smaller ones finish at once.
PROGRESS_MIN_BYTES = 20 * 1024 * 1024
# What `offline.classify` recognises, for the message when nothing under PATH is an input.
INPUT_PATTERNS = (
    "SDK records (*.jsonl)",
    "Kineto traces (*.json, *.json.gz, or JSON with traceEvents)",
    "Flight Recorder dumps (pickle or JSON, any name)",
    "py-spy/faulthandler stacks (*stack*.txt)",
)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a folder (searched recursively) or one file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--job", help="job id for findings from traces and dumps (default: folder name)"
    )
    parser.add_argument("--no-progress", action="store_true", help="never show a progress bar")


def _run(args: argparse.Namespace) -> int:
    try:
        sized = offline.discover(Path(args.path)) if Path(args.path).exists() else []
        total = sum(p.stat().st_size for p in sized)
        show = not args.no_progress and sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES
        if show:
            with Progress(
                TextColumn("[bold]analyzing"),
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                transient=True,
            ) as bar:
                task = bar.add_task("", total=total)

                def update(done: int, whole: int, name: str) -> None:
                    bar.update(task, completed=done, total=whole, description=name[-40:])

                result = offline.analyze_path(args.path, job_id=args.job, progress=update)
        else:
            result = offline.analyze_path(args.path, job_id=args.job)
    except FileNotFoundError as exc:
        sys.stderr.write(f"vigil analyze: {exc}\n")
        return 2
    except OSError as exc:  # e.g. a folder it may not list
        where = exc.filename or args.path
        sys.stderr.write(f"vigil analyze: cannot read {where}: {exc.strerror or exc}\n")
        return 1
    if not result.files:
        sys.stderr.write(_nothing_found(Path(args.path), len(sized)))
        return 2
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(result), indent=1) + "\n")
    else:
        sys.stdout.write(report.to_text(result))
    return _judge_errors(result)


def _nothing_found(path: Path, num_seen: int) -> str:
    if path.is_dir():
        seen = f"its {num_seen} file(s) are none of" if num_seen else "no files, looked for"
        head = f"no input files under {path} (searched recursively): {seen}"
    else:
        head = f"{path} is none of"
    kinds = "".join(f"\n  {pattern}" for pattern in INPUT_PATTERNS)
    return f"vigil analyze: {head}:{kinds}\n"


def _analysed_anything(result: offline.Report) -> bool:
    return bool(result.num_records or result.traces or result.num_dumps or result.stack_groups)


def _judge_errors(result: offline.Report) -> int:
    """Name the inputs that could not be read; 1 when nothing at all could be."""
    if not result.errors:
        return 0
    if not _analysed_anything(result):
        lines = "".join(f"\n  {e.path}: {e.reason}" for e in result.errors)
        sys.stderr.write(f"vigil analyze: error: none of the inputs could be analysed:{lines}\n")
        return 1
    names = sorted({_file_of(e.path) for e in result.errors})
    sys.stderr.write(
        f"vigil analyze: warning: skipped what could not be analysed in {', '.join(names)} (the "
        "report says why); analysed the rest\n"
    )
    return 0


def _file_of(where: str) -> str:
    """The file an error is about: errors on one line of a file read `path:line`."""
    path, _, line = where.rpartition(":")
    return path if path and line.isdigit() else where


analyze_command = core_cli.Command(
    name="analyze",
    help="analyse SDK JSONL files, Kineto traces and Flight Recorder dumps offline",
    configure=_configure,
    run=_run,
)
