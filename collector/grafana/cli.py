"""`vigil dashboards export DIR` and `vigil dashboards push --grafana URL`.

export writes the dashboards, rule files and Grafana provisioning files (export.py); push uploads
the dashboards through Grafana's HTTP API (push.py) with a token from `--token` or
`VIGIL_GRAFANA_TOKEN`, never printed. Each failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vigil.cli import Command, ensure_writable_dir, positive_float, url_problem
from vigil.collector.grafana import builder, export, push
from vigil.env import EnvVar


def _http_url(text: str) -> str:
    problem = url_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {problem}")
    return text


def _configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="{export,push}")
    out = sub.add_parser("export", help="write dashboards, rules and provisioning files to DIR")
    out.add_argument("dir", type=Path, metavar="DIR")
    out.add_argument(
        "--prometheus",
        type=_http_url,
        default="http://localhost:9090",
        help="URL of the Prometheus the provisioned data source points at",
    )
    out.add_argument(
        "--dashboards-path",
        default=None,
        help="absolute path Grafana reads the JSON from (default: DIR itself)",
    )
    out.add_argument("--ui", type=_http_url, default=builder.DEFAULT_UI, help="vigil UI URL")
    out.add_argument("--agent-job", default="vigil-agent", help="scrape job of the node agents")
    out.add_argument("--collector-job", default="vigil-collector", help="... of the collector")
    up = sub.add_parser("push", help="upload the dashboards to a Grafana")
    up.add_argument("--grafana", type=_http_url, required=True, metavar="URL")
    up.add_argument(
        "--token",
        default=None,
        help=f"Grafana service-account token (default: ${EnvVar.GRAFANA_TOKEN})",
    )
    up.add_argument("--folder", default="vigil", help="Grafana folder title (uid vigil)")
    up.add_argument("--timeout", type=positive_float, default=10.0, help="seconds per API call")


def _fail(message: str) -> int:
    sys.stderr.write(f"vigil dashboards: {message}\n")
    return 1


def _export(args: argparse.Namespace) -> int:
    try:
        config = export.ExportConfig(
            dashboards_path=args.dashboards_path,
            prometheus_url=args.prometheus,
            ui_url=args.ui,
            agent_job=args.agent_job,
            collector_job=args.collector_job,
        )
        ensure_writable_dir(args.dir)
        written = export.write(args.dir, config)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    sys.stdout.write(f"wrote {len(written)} files to {args.dir}\n")
    return 0


def _push(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get(EnvVar.GRAFANA_TOKEN, "")
    try:
        config = push.PushConfig(
            url=args.grafana, token=token, folder=args.folder, timeout_s=args.timeout
        )
        uids = push.push(config)
    except (ValueError, push.PushError) as exc:
        return _fail(str(exc))
    sys.stdout.write(f"pushed {len(uids)} dashboards to {args.grafana}: {', '.join(uids)}\n")
    return 0


def _run(args: argparse.Namespace) -> int:
    return _export(args) if args.action == "export" else _push(args)


dashboards_command = Command(
    name="dashboards",
    help="export or push vigil's Grafana dashboards and Prometheus rules",
    configure=_configure,
    run=_run,
)
