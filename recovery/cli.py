"""`vigil run`: supervise a training command's ranks on this host and recover them.

Argument parsing and wiring only; the work happens in controller/local/policy.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vigil import cli
from vigil.env import EnvVar
from vigil.recovery import controller, journal, local, placement, policy, snapshot_files

log = logging.getLogger(__name__)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=cli.positive_int, required=True, help="ranks in the job")
    parser.add_argument(
        "--nodes", type=cli.positive_int, default=1, help="simulated nodes the ranks spread over"
    )
    parser.add_argument(
        "--spare", type=cli.non_negative_int, default=0, help="spare simulated nodes to migrate to"
    )
    parser.add_argument(
        "--max-restarts", type=cli.non_negative_int, default=3, help="restarts before giving up"
    )
    parser.add_argument(
        "--min-dp", type=cli.positive_int, default=1, help="smallest data-parallel size to keep"
    )
    parser.add_argument(
        "--job",
        default=None,
        help="job id (default: a fresh vigil-run-<UTC time>-<random> per run, printed at start)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="controller journal, logs and stacks (default: ./vigil-runs/<job>); an unfinished "
        "run here is resumed",
    )
    parser.add_argument(
        "--cooldown",
        type=cli.non_negative_float,
        default=0.0,
        help="seconds between restarts (default 0)",
    )
    parser.add_argument(
        "--snapshot-dir",
        type=Path,
        default=snapshot_files.DEFAULT_ROOT,
        help="node shared memory for per-step snapshots (default %(default)s)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")


def _run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.stderr.write("vigil run: give the training command after `--`\n")
        return 2
    try:
        layout = placement.Placement.build(nproc=args.nproc, nodes=args.nodes, spare=args.spare)
        job_id = args.job or cli.unique_job_name("vigil-run")
        run_dir = args.run_dir or Path("vigil-runs") / job_id
        # Built first: it refuses a command that cannot run before any folder is made.
        executor = local.LocalExecutor(
            command=command,
            run_dir=run_dir,
            env={EnvVar.JOB: job_id},
            snapshot_root=args.snapshot_dir,
        )
        book = journal.Journal(run_dir)
        saved = book.load_state()
        if saved is not None and saved.finished:
            sys.stderr.write(f"vigil run: {run_dir} holds a finished run; pick another --run-dir\n")
            return 2
        config = controller.ControllerConfig(
            job_id=job_id,
            run_id=saved.run_id if saved else uuid.uuid4().hex,
            max_restarts=args.max_restarts,
            min_dp_size=args.min_dp,
            budget=policy.Budget(cooldown_s=args.cooldown),
        )
    except ValueError as exc:
        sys.stderr.write(f"vigil run: {exc}\n")
        return 2
    sys.stderr.write(f"vigil run: job {job_id}; journal, rank logs and stacks in {run_dir}\n")
    ctl = controller.Controller(config=config, executor=executor, journal=book, placement=layout)
    code = ctl.run()
    if code != 0:
        logs = executor.run_dir / "attempts"
        sys.stderr.write(f"vigil run: job {job_id} failed (exit {code}); rank logs in {logs}\n")
    if code == 0 and args.snapshot_dir is not None:
        snapshot_files.drop_job(args.snapshot_dir, job_id)
    for action in book.actions():
        log.info("%s %s %s: %s", action.action_id, action.kind, action.state, action.result)
    return code


command = cli.Command(
    name="run",
    help="run a training command's ranks under the recovery controller",
    configure=_configure,
    run=_run,
)


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="shorter runs between faults (CI)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)"
    )
    parser.add_argument("--port", type=int, default=0, help="collector port (default: a free one)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def _run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from vigil.recovery import demo

    # Wide enough for the verdict table even when output is piped (rich assumes 80 columns then).
    console = Console(width=max(shutil.get_terminal_size().columns, 120))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vigil-demo-"))
    console.print(f"vigil demo: working in {workdir} (collector, agent, controller, 4 ranks)")
    started = time.monotonic()
    code, rows, url = demo.run(workdir=workdir, quick=args.quick, port=args.port)
    if args.json:
        sys.stdout.write(demo.describe(rows) + "\n")
    table = Table(title=f"vigil demo: {time.monotonic() - started:.0f} s")
    for column in ("fault", "detected after (s)", "culprit", "action", "time to recover (s)",
                   "steps lost", "ok"):  # fmt: skip
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.fault,
            _num(row.detected_after_s),
            f"{row.culprit} (expected {row.expected_culprit})",
            row.action,
            _num(row.recover_s),
            "-" if row.steps_lost is None else str(row.steps_lost),
            "yes" if row.ok else "NO",
        )
    console.print(table)
    console.print(f"collector was at {url} (store: {workdir / 'collector.sqlite3'})")
    console.print("all three faults detected, named and recovered" if code == 0 else "demo FAILED")
    return code


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


demo_command = cli.Command(
    name="demo",
    help="run the whole platform locally and watch it find and fix three faults",
    configure=_configure_demo,
    run=_run_demo,
)
