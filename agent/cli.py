"""`vigil agent`: run the node agent, or send a control request to local ranks.

    vigil agent --metrics-port 9464 [--collector URL] [--progress-dir /dev/shm/vigil]
    vigil agent --request checkpoint --job JOB [--rank R]

Published through the `vigil.commands` entry point; the only module here that prints.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from vigil import cli, settings, spool
from vigil.agent import config, daemon, progress
from vigil.cli import Command
from vigil.env import EnvVar


def _configure(parser: argparse.ArgumentParser) -> None:
    d = config.AgentConfig(node="-")
    parser.add_argument("--node", default=None, help="this host's name (default: hostname)")
    parser.add_argument("--progress-dir", type=Path, default=d.progress_dir)
    parser.add_argument("--output-dir", type=Path, default=None, help="env VIGIL_OUTPUT_DIR")
    parser.add_argument(
        "--collector", type=cli.collector_url, default=None, help="env VIGIL_COLLECTOR_URL"
    )
    parser.add_argument("--spool-dir", type=Path, default=None)
    parser.add_argument("--spool-max-bytes", type=int, default=d.spool_max_bytes)
    parser.add_argument("--metrics-host", default=d.metrics_host)
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port)
    parser.add_argument("--sample-interval", type=float, default=d.sample_interval_s)
    parser.add_argument("--poll-interval", type=float, default=d.poll_interval_s)
    parser.add_argument("--hang-factor", type=float, default=d.hang_factor)
    parser.add_argument("--min-hang", type=float, default=d.min_hang_s, help="seconds")
    parser.add_argument("--startup-grace", type=float, default=d.startup_grace_s, help="seconds")
    parser.add_argument("--page-ttl", type=float, default=d.page_ttl_s, help="seconds")
    parser.add_argument("--no-nvml", action="store_true", help="sample the host only")
    parser.add_argument(
        "--relay-port",
        type=int,
        default=None,
        help="relay this node's ranks' batches to the collector, several per request: point "
        "their VIGIL_COLLECTOR_URL at http://<relay host>:<port> (needs --collector)",
    )
    parser.add_argument("--relay-host", default=d.relay_host)
    parser.add_argument(
        "--relay-window", type=float, default=d.relay_window_s, help="seconds a frame may wait"
    )
    parser.add_argument(
        "--request", choices=["checkpoint", "dump_stacks"], help="send a control request and exit"
    )
    parser.add_argument("--job", help="the job a --request is for")
    parser.add_argument("--rank", type=int, help="one rank (default: every local rank of --job)")


def _request(args: argparse.Namespace) -> int:
    if not args.job:
        sys.stderr.write("--request needs --job\n")
        return 2
    sent = 0
    for path in progress.discover(args.progress_dir):
        reader = progress.PageReader(path)
        try:
            if reader.job == args.job and args.rank in (None, reader.rank):
                seq = reader.request_control(args.request)
                sys.stdout.write(f"rank {reader.rank}: {args.request} requested (#{seq})\n")
                sent += 1
        finally:
            reader.close()
    if not sent:
        sys.stderr.write(f"no local rank of job {args.job!r} under {args.progress_dir}\n")
    return 0 if sent else 1


def _run(args: argparse.Namespace) -> int:
    if args.request:
        return _request(args)
    env_out = os.environ.get(EnvVar.OUTPUT_DIR)
    collector = args.collector or os.environ.get(EnvVar.COLLECTOR_URL) or None
    problem = cli.url_problem(collector) if collector and not args.collector else ""
    if problem:  # --collector was checked by argparse; its environment fallback is checked here
        sys.stderr.write(f"vigil agent: {EnvVar.COLLECTOR_URL}={collector!r}: {problem}\n")
        return 2
    if args.relay_port is not None and not collector:
        sys.stderr.write(
            f"vigil agent: --relay-port needs a collector to relay to (--collector or "
            f"{EnvVar.COLLECTOR_URL})\n"
        )
        return 2
    try:
        cfg = config.AgentConfig(
            node=args.node or config.default_node(),
            progress_dir=args.progress_dir,
            output_dir=args.output_dir or (Path(env_out) if env_out else None),
            collector=collector,
            token=os.environ.get(EnvVar.TOKEN),
            spool_dir=args.spool_dir,
            spool_max_bytes=args.spool_max_bytes,
            # What `vigil diag` runs on this node left unsent (it spools under the data dir).
            replay_dirs=(spool.diag_dir(settings.CommonSettings().data_dir),),
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            sample_interval_s=args.sample_interval,
            poll_interval_s=args.poll_interval,
            hang_factor=args.hang_factor,
            min_hang_s=args.min_hang,
            startup_grace_s=args.startup_grace,
            use_nvml=not args.no_nvml,
            page_ttl_s=args.page_ttl,
            relay_port=args.relay_port,
            relay_host=args.relay_host,
            relay_window_s=args.relay_window,
        )
    except ValueError as exc:  # a value out of range: one line, as argparse says it
        sys.stderr.write(f"vigil agent: {exc}\n")
        return 2
    agent = daemon.Agent(cfg)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        port = agent.start()
    except OSError as exc:  # a port taken, an address this host does not have
        agent.stop()
        sys.stderr.write(f"vigil agent: cannot listen: {exc}\n")
        return 2
    sys.stdout.write(f"vigil agent: metrics on http://{cfg.metrics_host}:{port}/metrics\n")
    if agent.relay is not None:
        sys.stdout.write(
            f"vigil agent: relaying batches to {collector}; ranks on this node ship to "
            f"{EnvVar.COLLECTOR_URL}={agent.relay.url}\n"
        )
    sys.stdout.flush()
    try:
        agent.run(stop)
    finally:
        agent.stop()
    return 0


agent_command = Command(
    name="agent",
    help="run the per-node agent (NVML/host sampling, hang watchdog, /metrics, shipping)",
    configure=_configure,
    run=_run,
)
