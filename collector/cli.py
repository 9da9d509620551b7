"""`vigil collector`: serve the collector with uvicorn (published in the vigil.commands group).

Builds `CollectorSettings` from VIGIL_* variables and the command line, refuses an open bind
without tokens (unless dev mode), and says at start whether auth is on. Must not be imported by
the core.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from vigil.analyzer import StreamingAnalyzer
from vigil.cli import Command
from vigil.collector import server
from vigil.collector.app import create_app
from vigil.collector.settings import CollectorSettings, is_loopback

log = logging.getLogger(__name__)
# Seconds uvicorn waits for in-flight requests at shutdown; a 32 MiB batch commits well within it.
GRACEFUL_SHUTDOWN_S = 30


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address (env VIGIL_COLLECTOR_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (env VIGIL_COLLECTOR_PORT, default 8470)")
    parser.add_argument(
        "--store",
        help="sqlite:///PATH or postgresql+psycopg://USER@HOST/DB "
        "(env VIGIL_STORE_URL, default <data dir>/collector.sqlite3)",
    )
    parser.add_argument(
        "--no-analyzer",
        action="store_true",
        help="store only; do not run the streaming analyzer on ingested batches",
    )


def _settings(args: argparse.Namespace) -> CollectorSettings:
    overrides = {
        key: value
        for key, value in (
            ("collector_host", args.host),
            ("collector_port", args.port),
            ("store_url", args.store),
        )
        if value is not None
    }
    return CollectorSettings(**overrides)


def _run(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
    except ValidationError as exc:
        for error in exc.errors():
            log.error("bad collector setting: %s", error["msg"].removeprefix("Value error, "))
        return 2
    if not settings.auth_enabled:
        where = "loopback only" if is_loopback(settings.collector_host) else "DEV MODE, unprotected"
        log.warning(
            "no tokens configured (VIGIL_INGEST_TOKENS / VIGIL_READ_TOKENS / VIGIL_TOKEN): "
            "auth is off, serving %s:%d (%s)",
            settings.collector_host,
            settings.collector_port,
            where,
        )
    log.info("collector store: %s", _redacted(settings.resolved_store_url))
    analyzer = None if args.no_analyzer else StreamingAnalyzer()
    app = create_app(settings, analyzer=analyzer)
    uvicorn.run(
        app,
        host=settings.collector_host,
        port=settings.collector_port,
        log_config=None,  # keep vigil's logging configuration
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        access_log=False,
        http=server.header_deadline_protocol(settings.header_timeout_s),
        limit_concurrency=settings.max_connections,
    )
    return 0


def _redacted(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


collector_command = Command(
    name="collector",
    help="run the collector: ingest, storage, query API and /metrics",
    configure=_configure,
    run=_run,
)
