"""The web UI's HTTP side: its pages, static assets, the data its pages fetch, and the security
headers every /ui response carries.

Pages are one static shell (templates/index.html) with no data in it: the scripts read the job
and view from the URL and fetch JSON (and the heat map's binary cells) from /ui/api with the
read token from sessionStorage in an Authorization header, so pages need no token and tokens
never appear in URLs. Every /ui/api route needs the read scope when auth is on, like the query
API. A Content-Security-Policy allows this origin's scripts, styles and fetches only (no inline
script, no CDN). Must not write to the store.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vigil.collector import auth, queries, trace_export
from vigil.collector.context import CollectorContext, json_response
from vigil.collector.routes_query import INT64, reject_nul, step_window
from vigil.collector.ui import cells, summaries

HERE = Path(__file__).parent
INDEX = HERE / "templates" / "index.html"
STATIC = HERE / "static"
PREFIX = "/ui"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
JobId = Annotated[str, PathParam(min_length=1, max_length=256)]
Step = Annotated[int | None, Query(ge=0, le=INT64)]
# Steps of a timeline or trace download from the UI: a window, not a run's whole history.
MAX_TRACE_STEPS = 200


class SecurityHeaders:
    """ASGI middleware: the CSP and friends on every response under /ui (and the / redirect);
    other paths pass untouched, so ingest pays nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == "/" or path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def mount(app: FastAPI, ctx: CollectorContext) -> None:
    """Add the UI to the collector's app: pages, /ui/static, /ui/api and the headers."""
    app.add_middleware(SecurityHeaders)
    app.include_router(_pages())
    app.include_router(_data(ctx))
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC), name="ui-static")


def _pages() -> APIRouter:
    r = APIRouter(include_in_schema=False)

    @r.get("/")
    @r.get(PREFIX)
    def home() -> Response:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    @r.get(f"{PREFIX}/")
    @r.get(PREFIX + "/jobs/{job_id}")
    def page(job_id: str = "") -> Response:
        return FileResponse(INDEX, media_type="text/html", headers={"cache-control": "no-store"})

    return r


def _window(
    conn: Any, job_id: str, start: int | None, end: int | None, width: int
) -> tuple[int, int]:
    return step_window(start, end, width, lambda: queries.last_step(conn, job_id))


def _data(ctx: CollectorContext) -> APIRouter:
    read = Depends(auth.require(auth.Scope.READ, ctx.settings))
    r = APIRouter(prefix=f"{PREFIX}/api", dependencies=[read, Depends(reject_nul)])
    r.include_in_schema = False

    @r.get("/jobs")
    def jobs() -> Response:
        with ctx.store.read() as conn:
            return json_response(summaries.jobs(conn))

    @r.get("/jobs/{job_id}")
    def job(job_id: JobId) -> Response:
        with ctx.store.read() as conn:
            if not queries.job_exists(conn, job_id):
                raise HTTPException(404, detail=f"no job {job_id!r}")
            return json_response(summaries.overview(conn, job_id, now_s=ctx.clock()))

    @r.get("/jobs/{job_id}/series")
    def series(job_id: JobId, step_start: Step = None, step_end: Step = None) -> Response:
        with ctx.store.read() as conn:
            body = summaries.series(conn, job_id, step_start=step_start, step_end=step_end)
        return json_response(body)

    @r.get("/jobs/{job_id}/heatmap")
    def heat(
        job_id: JobId,
        metric: cells.Metric = cells.Metric.STEP_TIME,
        group: cells.Grouping = cells.Grouping.RANK,
        step_start: Step = None,
        step_end: Step = None,
        row_start: Annotated[int, Query(ge=0, le=INT64)] = 0,
        row_end: Step = None,
        max_cols: Annotated[int, Query(ge=1, le=4000)] = 500,
        max_rows: Annotated[int, Query(ge=1, le=4000)] = 800,
    ) -> Response:
        """Binary: see `cells.encode`."""
        with ctx.store.read() as conn:
            start, end = _window(conn, job_id, step_start, step_end, 1000)
            try:
                view = cells.View(
                    metric=metric,
                    grouping=group,
                    step_start=start,
                    step_end=end,
                    row_start=row_start,
                    row_end=row_end,
                    max_cols=max_cols,
                    max_rows=max_rows,
                )
                body = cells.read(conn, job_id, view)
            except ValueError as exc:
                raise HTTPException(422, detail=str(exc)) from exc
        return Response(body, media_type="application/octet-stream")

    @r.get("/jobs/{job_id}/cell")
    def cell(
        job_id: JobId,
        rank: Annotated[int, Query(ge=0, le=INT64)],
        step: Annotated[int, Query(ge=0, le=INT64)],
    ) -> Response:
        with ctx.store.read() as conn:
            return json_response(summaries.cell(conn, job_id, rank=rank, step=step))

    @r.get("/jobs/{job_id}/hang")
    def hang(job_id: JobId) -> Response:
        with ctx.store.read() as conn:
            return json_response(summaries.hang(conn, job_id))

    @r.get("/jobs/{job_id}/timeline")
    def timeline(
        job_id: JobId,
        step_start: Step = None,
        step_end: Step = None,
        ranks: Annotated[str, Query(max_length=4000, pattern=r"^[0-9,]*$")] = "",
    ) -> Response:
        """The trace window's events of the chosen ranks (all when none are named)."""
        body = _trace(ctx, job_id, step_start, step_end)
        wanted = {int(x) for x in ranks.split(",") if x}
        if wanted:
            body["traceEvents"] = [e for e in body["traceEvents"] if e.get("pid") in wanted]
        return json_response(body)

    @r.get("/jobs/{job_id}/trace.json.gz")
    def trace(job_id: JobId, step_start: Step = None, step_end: Step = None) -> Response:
        """The window as a gzipped Chrome trace, to open in Perfetto (ui.perfetto.dev or a
        self-hosted one) or chrome://tracing."""
        body = _trace(ctx, job_id, step_start, step_end)
        data = gzip.compress(msgspec.json.encode(body), compresslevel=6)
        name = f"vigil-steps-{body['otherData']['step_start']}-{body['otherData']['step_end']}"
        return Response(
            data,
            media_type="application/gzip",
            headers={"content-disposition": f'attachment; filename="{name}.json.gz"'},
        )

    return r


def _trace(ctx: CollectorContext, job_id: str, start: int | None, end: int | None) -> Any:
    with ctx.store.read() as conn:
        first, last = _window(conn, job_id, start, end, 10)
        if last - first + 1 > MAX_TRACE_STEPS:
            raise HTTPException(413, detail=f"a trace window holds at most {MAX_TRACE_STEPS} steps")
        try:
            return trace_export.chrome_trace(conn, job_id, step_start=first, step_end=last)
        except trace_export.WindowTooLargeError as exc:
            raise HTTPException(413, detail=str(exc)) from exc
