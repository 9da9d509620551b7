"""`create_app(settings)`: the collector's FastAPI application and its background loops.

Start-up opens the store and runs migrations before the first request; two loops run beside the
server: retention/rollups every `maintenance_interval_s`, and the analyzer's `tick` (hang detection
without new records) every `analyzer_tick_s` when the analyzer has one, and when it says a hang
could be due (`DueAnalyzer`) if that comes sooner. Must not bind sockets:
`vigil collector` (command.py) serves the app with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from vigil import _version
from vigil.collector import (
    auth,
    history,
    job_metrics,
    retention,
    routes_control,
    routes_ingest,
    routes_query,
    routes_upload,
    ui,
)
from vigil.collector.analyzer_runner import AnalyzerRunner, ResumingAnalyzer, StreamAnalyzer
from vigil.collector.commits import GroupCommit
from vigil.collector.context import CollectorContext, json_response
from vigil.collector.metrics import CollectorMetrics
from vigil.collector.settings import CollectorSettings
from vigil.collector.store import Store, StoreConfig
from vigil.collector.world import WorldSizes

log = logging.getLogger(__name__)


def create_app(
    settings: CollectorSettings,
    *,
    analyzer: StreamAnalyzer | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """The collector app; `analyzer` sees every committed batch through an `AnalyzerRunner`."""
    store = Store(StoreConfig(url=settings.resolved_store_url), clock=clock)
    runner_box: list[AnalyzerRunner] = []
    metrics = CollectorMetrics(
        store_size=store.size_bytes,
        analyzer_pending=lambda: float(runner_box[0].pending) if runner_box else 0.0,
        jobs=job_metrics.JobMetrics(store.read, clock=clock),
    )
    ctx = CollectorContext(
        settings=settings,
        store=store,
        metrics=metrics,
        clock=clock,
        world_sizes=WorldSizes(store.world_sizes),
        commits=GroupCommit(store, grouped=settings.ingest_group_commit),
    )
    if analyzer is not None:
        if isinstance(analyzer, ResumingAnalyzer):
            analyzer.use_history(functools.partial(history.recent, store))
        ctx.runner = AnalyzerRunner(
            analyzer,
            store_findings=store.store_findings,
            on_error=metrics.analyzer_errors.inc,
            on_drop=metrics.analyzer_dropped.inc,
            max_pending=settings.analyzer_max_pending,
            max_pending_records=settings.analyzer_max_pending_records,
        )
        runner_box.append(ctx.runner)
    docs_open = settings.docs_public or not settings.auth_enabled
    app = FastAPI(
        title="vigil collector",
        version=_version.__version__,
        description="Ingest, storage and query API for vigil's training telemetry.",
        lifespan=_lifespan(ctx),
        docs_url="/docs" if docs_open else None,
        redoc_url="/redoc" if docs_open else None,
        openapi_url="/openapi.json" if docs_open else None,
    )
    app.state.collector = ctx
    app.include_router(routes_ingest.router(ctx))
    app.include_router(routes_query.router(ctx))
    app.include_router(routes_upload.router(ctx))
    app.include_router(routes_control.router(ctx))  # control requests for ranks
    ui.mount(app, ctx)  # the web UI under /ui (collector/ui/)
    _ops_routes(app, ctx)
    if not docs_open:
        _protected_docs(app, ctx)
    return app


def _protected_docs(app: FastAPI, ctx: CollectorContext) -> None:
    """/openapi.json and /docs behind the read scope (auth on, VIGIL_DOCS_PUBLIC unset)."""
    read = [Depends(auth.require(auth.Scope.READ, ctx.settings))]

    @app.get("/openapi.json", include_in_schema=False, dependencies=read)
    def openapi() -> Response:
        return json_response(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=read)
    def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)


def _ops_routes(app: FastAPI, ctx: CollectorContext) -> None:
    @app.get("/healthz", tags=["ops"])
    def healthz() -> Response:
        """200 when the store answers."""
        try:
            with ctx.store.read() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # any store failure means "not healthy", reported, not raised
            return json_response({"status": "unavailable", "detail": type(exc).__name__}, 503)
        return json_response({"status": "ok", "store": ctx.store.dialect})

    public = ctx.settings.metrics_public or not ctx.settings.auth_enabled
    scrape = [] if public else [Depends(auth.require(auth.Scope.READ, ctx.settings))]

    @app.get("/metrics", tags=["ops"], response_class=Response, dependencies=scrape)
    def prometheus_metrics() -> Response:
        """The collector's own metrics in Prometheus text format."""
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _lifespan(
    ctx: CollectorContext,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        revision = await run_in_threadpool(ctx.store.migrate)
        log.info(
            "collector store %s ready at schema %s; auth %s",
            ctx.store.dialect,
            revision,
            "on (bearer tokens)" if ctx.settings.auth_enabled else "off (no tokens configured)",
        )
        policy = retention.RetentionPolicy(
            raw_retention_s=ctx.settings.raw_retention_s,
            rollup_bucket_s=ctx.settings.rollup_bucket_s,
        )
        loops = [
            _every(
                ctx.settings.maintenance_interval_s,
                "maintenance",
                lambda: run_in_threadpool(retention.run_once, ctx.store, policy, now_s=ctx.clock()),
            ),
        ]
        if ctx.runner is not None:
            runner = ctx.runner
            loops.append(_ticking(runner, ctx.clock, ctx.settings.analyzer_tick_s))
        tasks = [asyncio.create_task(loop) for loop in loops]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if ctx.runner is not None:
                await run_in_threadpool(ctx.runner.close)
            ctx.store.close()

    return lifespan


# How often the tick loop looks at the analyzer's `due_s` between ticks.
_DUE_POLL_S = 0.2


async def _ticking(runner: AnalyzerRunner, clock: Callable[[], float], interval_s: float) -> None:
    """Tick the analyzer every `interval_s`, and at its `due_s` (a hang's silence passing its
    threshold) when that comes sooner, until cancelled; a failure is logged."""
    last = clock()
    while True:
        wake = last + interval_s
        due = runner.due_s  # re-read at least every `_DUE_POLL_S`: records may bring it closer
        if due is not None and last < due < wake:
            wake = due
        now = clock()
        if now < wake:
            await asyncio.sleep(min(wake - now, _DUE_POLL_S))
            continue
        last = now
        try:
            runner.tick(last)
        except Exception:  # a background failure must not stop the loop or the server
            log.exception("analyzer tick failed; retrying in %.0f s", interval_s)


async def _every(interval_s: float, name: str, call: Callable[[], Awaitable[Any]]) -> None:
    """Run `call` every `interval_s` until cancelled; a failure is logged and retried next time."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await call()
        except Exception:  # a background failure must not stop the loop or the server
            log.exception("%s failed; retrying in %.0f s", name, interval_s)
