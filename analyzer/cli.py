"""The `vigil analyze PATH` subcommand (published through the `vigil.commands` entry points).

Uses only the standard library, rich (progress bar) and vigil core around the pure analyzer.
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
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(result), indent=1) + "\n")
    else:
        sys.stdout.write(report.to_text(result))
    return 0 if result.files else 2


analyze_command = core_cli.Command(
    name="analyze",
    help="analyse SDK JSONL files, Kineto traces and Flight Recorder dumps offline",
    configure=_configure,
    run=_run,
)
