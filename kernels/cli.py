"""`vigil diag`: run the node diagnostics, show a verdict per test, ship results to a collector.

Output is a table for people, or with --json one `vigil.codec.encode_json` line per DiagResult
(the same lines `vigil analyze` reads and `--baseline` accepts). A rich progress bar goes to
stderr. The exit status is 0 when nothing is suspect or failed, 1 otherwise, so a launcher can
use `vigil diag --quick` as a pre-flight check. Only this module writes to the terminal; torch
and the kernels load only when the command runs, so `vigil` itself starts fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vigil import cli, codec, schema, settings, spool
from vigil.kernels import catalog, ship, verdict

if TYPE_CHECKING:
    from vigil.kernels.suite import Suite

log = logging.getLogger(__name__)
_STYLE = {"pass": "green", "suspect": "yellow", "fail": "bold red", "unknown": "dim"}


def configure(parser: argparse.ArgumentParser) -> None:
    level = parser.add_mutually_exclusive_group()
    level.add_argument("--quick", action="store_true", help="pre-flight checks (default)")
    level.add_argument("--full", action="store_true", help="every diagnostic at full size")
    parser.add_argument("--json", action="store_true", help="one JSON DiagResult per line")
    parser.add_argument(
        "--collector",
        type=cli.collector_url,
        help="collector URL (default: env VIGIL_COLLECTOR_URL)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="fleet baseline: JSON {test: value} or JSON lines of earlier `vigil diag --json`",
    )
    parser.add_argument("--node", help="node name in the results (default: the host name)")
    parser.add_argument(
        "--only",
        help=f"comma-separated diagnostics to run, of: {', '.join(catalog.DIAGNOSTICS)}",
    )
    parser.add_argument("--cpu", action="store_true", help="test the CPU even where GPUs exist")


def run(args: argparse.Namespace) -> int:
    # torch loads here, not when `vigil` starts: every other subcommand stays fast.
    from vigil.kernels import devices, suite

    common = settings.CommonSettings()
    level = suite.Level.FULL if args.full else suite.Level.QUICK
    targets = devices.local_targets(cpu=args.cpu)
    plan = suite.default_plan(level, on_gpu=targets[0].is_cuda)
    if args.only:
        plan = plan.only({name.strip() for name in args.only.split(",") if name.strip()})
    fleet = verdict.FleetBaseline.load(args.baseline) if args.baseline else verdict.FleetBaseline()
    runner = suite.Suite(plan=plan, targets=targets, fleet=fleet)
    if args.node:
        runner.node = args.node
    results = _run_with_progress(runner)
    _print(results, as_json=args.json)
    url = args.collector or common.collector_url
    if url:
        _ship(results, url, common)
    return 0 if suite.healthy(results) else 1


def _run_with_progress(runner: Suite) -> list[schema.DiagResult]:
    console = Console(stderr=True)
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=not console.is_terminal) as bar:
        steps = runner.steps()
        task = bar.add_task(f"diag: {steps[0] if steps else ''}", total=len(steps))

        def advance(done: str) -> None:
            index = steps.index(done) + 1 if done in steps else 0
            following = steps[index] if index < len(steps) else "done"
            bar.update(task, advance=1, description=f"diag: {following}")

        return runner.run(progress=advance)


def _print(results: list[schema.DiagResult], *, as_json: bool) -> None:
    if as_json:
        for record in results:
            sys.stdout.write(codec.encode_json(record).decode() + "\n")
        return
    table = Table(title="vigil diag")
    for column in ("device", "test", "value", "unit", "fleet", "spec", "verdict"):
        table.add_column(
            column, justify="right" if column in ("value", "fleet", "spec") else "left"
        )
    for r in results:
        table.add_row(
            r.device,
            r.test,
            _num(r.value),
            r.unit,
            _num(r.baseline),
            _num(r.spec),
            f"[{_STYLE[r.verdict.value]}]{r.verdict.value}[/]",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # pipes and CI logs: do not squeeze the table to 80 columns
    console.print(table)


def _num(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if abs(value) >= 1e6 or value == int(value) else f"{value:.4g}"


def _ship(results: list[schema.DiagResult], url: str, common: settings.CommonSettings) -> None:
    config = ship.ShipConfig(url=url, token=common.token, spool_dir=spool.diag_dir(common.data_dir))
    outcome = ship.send(results, config)
    message = f"diag results {outcome.delivery.value} ({outcome.batch_id}) {outcome.detail}".strip()
    Console(stderr=True).print(message)


diag_command = cli.Command(
    name="diag",
    help="run node diagnostics (GEMM, memory, SDC, links, clocks) and judge them",
    configure=configure,
    run=run,
)
