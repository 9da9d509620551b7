"""`vigil run`: supervise a training command's ranks on this host and recover them.

Argument parsing and wiring only; the work happens in controller/local/policy.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vigil import cli, settings
from vigil.agent import rundir
from vigil.env import EnvVar
from vigil.recovery import (
    attempts,
    collector_link,
    console,
    controller,
    journal,
    local,
    placement,
    policy,
    snapshot_files,
)

log = logging.getLogger(__name__)


# Default for --output-dir, as the SDK's (VIGIL_OUTPUT_DIR wins over it).
DEFAULT_OUTPUT_DIR = Path("vigil-output")


def _epilog() -> str:
    width = max(len(name) for name, _ in local.RANK_ENV)
    env = "\n".join(f"  {name:<{width}}  {what}" for name, what in local.RANK_ENV)
    return f"""\
Each rank runs the command with the caller's environment plus:
{env}
  {EnvVar.OUTPUT_DIR.value:<{width}}  --output-dir, made absolute (where the SDK writes JSONL)
  {EnvVar.COLLECTOR_URL.value:<{width}}  --collector, when given

Where output goes:
  console                          the current attempt's rank output, each line prefixed
                                   "[rank N] " (not with --quiet)
  RUN_DIR/attempts/attempt-A/      rank-R.log: rank R's stdout and stderr in attempt A (kept)
  RUN_DIR/actions.jsonl            the controller's journal (every action, each state)
  RUN_DIR/stacks/                  stacks dumped for a hang
  OUTPUT_DIR/JOB/                  the SDK's records without a collector: rank-NNNNN.jsonl,
                                   rank-NNNNN.attempt-A.jsonl after restart A, and
                                   controller.jsonl (crashes, restarts with the resume step
                                   and steps lost, diagnostics): `vigil analyze OUTPUT_DIR/JOB`
"""


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _epilog()
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
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help=f"the job's offline record, OUTPUT_DIR/JOB/ (default ${EnvVar.OUTPUT_DIR.value}, "
        f"else ./{DEFAULT_OUTPUT_DIR})",
    )
    parser.add_argument(
        "--collector",
        type=cli.collector_url,
        default=None,
        help=f"collector URL: the controller posts its record there and acts on its findings "
        f"(default ${EnvVar.COLLECTOR_URL.value}; none: files only)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="do not copy the ranks' output to the console"
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
        common = settings.CommonSettings()
        url = args.collector or common.collector_url or None
        env_out = os.environ.get(EnvVar.OUTPUT_DIR, "").strip()
        output_dir = (args.output_dir or Path(env_out or DEFAULT_OUTPUT_DIR)).absolute()
        rank_env = {EnvVar.JOB.value: job_id, EnvVar.OUTPUT_DIR.value: str(output_dir)}
        if url:
            rank_env[EnvVar.COLLECTOR_URL.value] = url
        # Built first: it refuses a command that cannot run before any folder is made.
        executor = local.LocalExecutor(
            command=command,
            run_dir=run_dir,
            env=rank_env,
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
    records = output_dir / job_id
    sys.stderr.write(
        f"vigil run: job {job_id}; journal, rank logs and stacks in {run_dir}; the job's record "
        f"in {records}" + (f" and at {url}" if url else "") + "\n"
    )
    sinks: list[journal.RecordLog | collector_link.CollectorActions] = [
        journal.RecordLog(records / CONTROLLER_RECORD)
    ]
    if url:
        sinks.append(collector_link.CollectorActions(url=url, token=common.token))
    ctl = controller.Controller(
        config=config,
        executor=executor,
        journal=book,
        placement=layout,
        sink=journal.Tee(sinks),
        findings=collector_link.CollectorFindings(url=url, job_id=job_id, token=common.token)
        if url
        else None,
        steps=attempts.ProgressWatch(
            job_id=job_id,
            progress_root=rundir.progress_root(),
            records_dir=None if url else records,
            remote=collector_link.CollectorSteps(url=url, job_id=job_id, token=common.token)
            if url
            else None,
        ),
    )
    echo = None
    if not args.quiet:
        echo = console.RankEcho(current_dir=executor.current_attempt_dir, out=sys.stdout)
        echo.start()
    try:
        code = ctl.run()
    finally:
        if echo is not None:
            echo.stop()
        for sink in sinks:
            if isinstance(sink, collector_link.CollectorActions):
                sink.replay()
                sink.close()
    if code != 0:
        logs = executor.run_dir / "attempts"
        sys.stderr.write(f"vigil run: job {job_id} failed (exit {code}); rank logs in {logs}\n")
    if code == 0 and args.snapshot_dir is not None:
        snapshot_files.drop_job(args.snapshot_dir, job_id)
    for action in book.actions():
        log.info("%s %s %s: %s", action.action_id, action.kind, action.state, action.result)
    return code


# The controller's record beside the ranks' JSONL files (read by `vigil analyze`).
CONTROLLER_RECORD = "controller.jsonl"

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
    parser.add_argument(
        "--keep", action="store_true", help="leave the collector serving its web UI afterwards"
    )


def _run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from vigil.recovery import demo

    # Wide enough for the verdict table even when output is piped (rich assumes 80 columns then).
    console = Console(width=max(shutil.get_terminal_size().columns, 120))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vigil-demo-"))
    console.print(f"vigil demo: working in {workdir} (collector, agent, controller, 4 ranks)")
    started = time.monotonic()
    port = args.port or local.free_port()
    console.print(f"web UI: http://127.0.0.1:{port}/ui/ (live while the demo runs)")
    code, rows, url = demo.run(workdir=workdir, quick=args.quick, port=port, keep=args.keep)
    if args.json:
        sys.stdout.write(demo.describe(rows) + "\n")
    table = Table(title=f"vigil demo: {time.monotonic() - started:.0f} s")
    for column in ("fault", "detected after s (steps)", "culprit", "action", "diagnosis",
                   "time to recover (s)", "steps lost", "ok"):  # fmt: skip
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.fault,
            _num(row.detected_after_s)
            + ("" if row.detected_after_steps is None else f" ({row.detected_after_steps})"),
            f"{row.culprit} (expected {row.expected_culprit})",
            row.action,
            row.diagnosis,
            _num(row.recover_s),
            "-" if row.steps_lost is None else str(row.steps_lost),
            "yes" if row.ok else "NO",
        )
    console.print(table)
    console.print(f"collector was at {url} (store: {workdir / 'collector.sqlite3'})")
    if args.keep:
        pid = workdir / "collector.pid"
        console.print(
            f"the collector keeps serving the web UI at {url}/ui/ (stop it: kill $(cat {pid}))"
        )
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
