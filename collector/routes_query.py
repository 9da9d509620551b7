"""The read API under /api/v1: jobs, ranks, steps, heatmaps, collectives, findings, actions,
checkpoints, samples, diag results, Chrome-trace export and Kineto trace download.

Every route needs the `read` scope when auth is on (trace upload, in routes_upload.py, needs
`ingest`). Bad parameters are 4xx with a message; nothing here writes. Handlers are sync:
FastAPI runs them in its thread pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import Response

from vigil import api
from vigil.collector import auth, heatmap, kineto, queries, samples, trace_export
from vigil.collector import models as m
from vigil.collector.context import CollectorContext, json_response

INT64 = 2**62  # bound query integers well inside the store's 64-bit columns
JobId = Annotated[str, Path(min_length=1, max_length=256)]
StepStart = Annotated[int | None, Query(ge=0, le=INT64, description="first step (inclusive)")]
StepEnd = Annotated[int | None, Query(ge=0, le=INT64, description="last step (inclusive)")]
Limit = Annotated[int, Query(ge=1, le=queries.MAX_ROWS)]
OptName = Annotated[str | None, Query(min_length=1, max_length=256)]
Time = Annotated[float, Query(ge=0, le=1e12, allow_inf_nan=False)]
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": m.ErrorPublic}}


def reject_nul(request: Request) -> None:
    """Neither SQLite keys nor PostgreSQL text may hold NUL: refuse it up front."""
    if "\x00" in request.url.path or any("\x00" in v for v in request.query_params.values()):
        raise HTTPException(422, detail="parameters must not contain NUL characters")


def _window(
    ctx: CollectorContext, job_id: str, start: int | None, end: int | None, width: int
) -> tuple[int, int]:
    def last() -> int | None:
        with ctx.store.read() as conn:
            return queries.last_step(conn, job_id)

    return step_window(start, end, width, last)


def step_window(
    start: int | None, end: int | None, width: int, last_step: Callable[[], int | None]
) -> tuple[int, int]:
    """An explicit step range, or the last `width` steps the job reported (`last_step`, read
    only when no end is given); 422 for a range that ends before it starts."""
    if end is None:
        end = last_step() or 0
        if start is not None:
            end = max(end, start)
    if start is None:
        start = max(0, end - width + 1)
    if end < start:
        raise HTTPException(422, detail=f"step_end ({end}) is before step_start ({start})")
    return start, end


def router(ctx: CollectorContext) -> APIRouter:
    read = Depends(auth.require(auth.Scope.READ, ctx.settings))
    errors: dict[int | str, dict[str, Any]] = {c: {"model": m.ErrorPublic} for c in (401, 403)}
    r = APIRouter(prefix=api.API_PREFIX, dependencies=[read, Depends(reject_nul)], responses=errors)
    _job_routes(r, ctx)
    _step_routes(r, ctx)
    _record_routes(r, ctx)
    _trace_routes(r, ctx)
    return r


def _job_routes(r: APIRouter, ctx: CollectorContext) -> None:
    @r.get("/jobs", response_model=list[m.JobPublic], tags=["jobs"])
    def list_jobs(
        limit: Limit = 100, offset: Annotated[int, Query(ge=0, le=INT64)] = 0
    ) -> Response:
        """Jobs, newest first."""
        with ctx.store.read() as conn:
            return json_response(queries.list_jobs(conn, limit=limit, offset=offset))

    @r.get("/jobs/{job_id}", response_model=m.JobPublic, responses=_NOT_FOUND, tags=["jobs"])
    def get_job(job_id: JobId) -> Response:
        """One job's description (from its Job record)."""
        with ctx.store.read() as conn:
            job = queries.get_job(conn, job_id)
        if job is None:
            raise HTTPException(404, detail=f"no job {job_id!r}")
        return json_response(job)

    @r.get(
        "/jobs/{job_id}/state", response_model=m.JobStatePublic, responses=_NOT_FOUND, tags=["jobs"]
    )
    def job_state(job_id: JobId) -> Response:
        """Progress, per-rank last heartbeat and silence, open findings."""
        with ctx.store.read() as conn:
            if not queries.job_exists(conn, job_id):
                raise HTTPException(404, detail=f"no job {job_id!r}")
            return json_response(queries.job_state(conn, job_id, now_s=ctx.clock()))

    @r.get("/jobs/{job_id}/ranks", response_model=list[m.RankPublic], tags=["jobs"])
    def ranks(job_id: JobId) -> Response:
        """Where each rank runs (node, device, pid, pod)."""
        with ctx.store.read() as conn:
            return json_response(queries.ranks(conn, job_id))


def _step_routes(r: APIRouter, ctx: CollectorContext) -> None:
    @r.get("/jobs/{job_id}/steps", response_model=list[m.StepPublic], tags=["steps"])
    def steps(
        job_id: JobId,
        step_start: StepStart = None,
        step_end: StepEnd = None,
        rank: Annotated[int | None, Query(ge=0, le=INT64)] = None,
        limit: Limit = 10_000,
    ) -> Response:
        """Step records in a step range (default: the last 100 steps), by step then rank."""
        start, end = _window(ctx, job_id, step_start, step_end, 100)
        with ctx.store.read() as conn:
            rows = queries.steps(
                conn, job_id, step_start=start, step_end=end, rank=rank, limit=limit
            )
        return json_response(rows)

    @r.get(
        "/jobs/{job_id}/steps/by-rank", response_model=list[m.RankAggregatePublic], tags=["steps"]
    )
    def steps_by_rank(
        job_id: JobId, step_start: StepStart = None, step_end: StepEnd = None
    ) -> Response:
        """Per-rank means and maxima over a step range (default: the last 1,000 steps)."""
        start, end = _window(ctx, job_id, step_start, step_end, 1000)
        with ctx.store.read() as conn:
            return json_response(queries.per_rank(conn, job_id, step_start=start, step_end=end))

    @r.get("/jobs/{job_id}/heatmap", response_model=m.HeatmapPublic, tags=["steps"])
    def job_heatmap(
        job_id: JobId,
        metric: heatmap.HeatmapMetric = heatmap.HeatmapMetric.STEP_TIME,
        step_start: StepStart = None,
        step_end: StepEnd = None,
        max_steps: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> Response:
        """Rank x step matrix of step time, exposed comm wait or MFU (default: last 1,000 steps)."""
        start, end = _window(ctx, job_id, step_start, step_end, max_steps)
        with ctx.store.read() as conn:
            body = heatmap.heatmap(
                conn, job_id, metric=metric, step_start=start, step_end=end, max_steps=max_steps
            )
        return json_response(body)

    @r.get("/jobs/{job_id}/collectives", response_model=list[m.CollectivePublic], tags=["steps"])
    def collectives(
        job_id: JobId, step_start: StepStart = None, step_end: StepEnd = None, by_rank: bool = False
    ) -> Response:
        """Collective aggregates per (group, op), optionally per rank (default: last 100 steps)."""
        start, end = _window(ctx, job_id, step_start, step_end, 100)
        with ctx.store.read() as conn:
            rows = queries.collectives(
                conn, job_id, step_start=start, step_end=end, by_rank=by_rank
            )
        return json_response(rows)


def _record_routes(r: APIRouter, ctx: CollectorContext) -> None:
    @r.get("/findings", response_model=list[m.FindingPublic], tags=["findings"])
    def findings(
        job_id: OptName = None, state: OptName = None, kind: OptName = None, limit: Limit = 100
    ) -> Response:
        """Findings, newest first, optionally for one job, state or kind."""
        with ctx.store.read() as conn:
            return json_response(
                queries.findings(conn, job_id=job_id, state=state, kind=kind, limit=limit)
            )

    @r.get("/jobs/{job_id}/findings", response_model=list[m.FindingPublic], tags=["findings"])
    def job_findings(
        job_id: JobId, state: OptName = None, kind: OptName = None, limit: Limit = 100
    ) -> Response:
        """One job's findings, newest first."""
        with ctx.store.read() as conn:
            return json_response(
                queries.findings(conn, job_id=job_id, state=state, kind=kind, limit=limit)
            )

    @r.get("/actions", response_model=list[m.ActionPublic], tags=["findings"])
    def actions(job_id: OptName = None, limit: Limit = 100) -> Response:
        """Recovery actions, newest first."""
        with ctx.store.read() as conn:
            return json_response(queries.actions(conn, job_id=job_id, limit=limit))

    @r.get("/jobs/{job_id}/checkpoints", response_model=list[m.CheckpointPublic], tags=["jobs"])
    def checkpoints(job_id: JobId, limit: Limit = 100) -> Response:
        """A job's checkpoints, latest step first."""
        with ctx.store.read() as conn:
            return json_response(queries.checkpoints(conn, job_id, limit=limit))

    @r.get("/diag", response_model=list[m.DiagResultPublic], tags=["nodes"])
    def diag(node: OptName = None, limit: Limit = 1000) -> Response:
        """Diagnostic kernel results, newest first, optionally for one node."""
        with ctx.store.read() as conn:
            return json_response(queries.diag_results(conn, node=node, limit=limit))

    @r.get("/samples", response_model=m.SamplesPublic, tags=["nodes"])
    def sample_series(
        metric: Annotated[str, Query(min_length=1, max_length=256)],
        start_s: Time,
        end_s: Time,
        points: Annotated[int, Query(ge=1, le=10_000)] = 500,
        node: OptName = None,
        device: OptName = None,
        job_id: OptName = None,
    ) -> Response:
        """NVML/host samples of one metric, downsampled to at most `points` buckets per series."""
        try:
            query = samples.SampleQuery(
                metric=metric,
                start_s=start_s,
                end_s=end_s,
                points=points,
                node=node,
                device=device,
                job_id=job_id,
            )
        except ValueError as exc:
            raise HTTPException(422, detail=str(exc)) from exc
        with ctx.store.read() as conn:
            body = samples.series(conn, query, rollup_bucket_s=ctx.settings.rollup_bucket_s)
        return json_response(body)


def _trace_routes(r: APIRouter, ctx: CollectorContext) -> None:
    @r.get("/jobs/{job_id}/trace", response_model=m.ChromeTracePublic, tags=["traces"])
    def export_trace(
        job_id: JobId, step_start: StepStart = None, step_end: StepEnd = None
    ) -> Response:
        """A step window (default: the last 10 steps) as Chrome trace-event JSON for Perfetto."""
        start, end = _window(ctx, job_id, step_start, step_end, 10)
        try:
            with ctx.store.read() as conn:
                body = trace_export.chrome_trace(conn, job_id, step_start=start, step_end=end)
        except trace_export.WindowTooLargeError as exc:
            raise HTTPException(413, detail=str(exc)) from exc
        return json_response(body)

    @r.get("/jobs/{job_id}/traces", response_model=list[m.TraceInfoPublic], tags=["traces"])
    def list_traces(job_id: JobId) -> Response:
        """Uploaded traces of a job, newest first."""
        with ctx.store.read() as conn:
            return json_response(kineto.list_traces(conn, job_id))

    @r.get("/traces/{trace_id}", responses=_NOT_FOUND, tags=["traces"])
    def download_trace(trace_id: Annotated[str, Path(min_length=1, max_length=64)]) -> Response:
        """An uploaded trace's JSON, as uploaded."""
        with ctx.store.read() as conn:
            content = kineto.load(conn, trace_id)
        if content is None:
            raise HTTPException(404, detail=f"no trace {trace_id!r}")
        return Response(content, media_type="application/json")
