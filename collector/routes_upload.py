"""POST /api/v1/jobs/{job_id}/traces: a Kineto trace upload, with the `ingest` scope alone.

Uploads are large (the limit is `max_trace_bytes`, 256 MiB by default): one is parsed at a time,
and parsing costs about the inflated size in memory (`kineto.parse` builds no event objects).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from vigil import api
from vigil.collector import auth, kineto
from vigil.collector import models as m
from vigil.collector.context import CollectorContext, json_response, read_body
from vigil.collector.routes_query import INT64, JobId, reject_nul


def router(ctx: CollectorContext) -> APIRouter:
    ingest = Depends(auth.require(auth.Scope.INGEST, ctx.settings))
    errors: dict[int | str, dict[str, Any]] = {
        c: {"model": m.ErrorPublic} for c in (401, 403, 413, 422)
    }
    r = APIRouter(
        prefix=api.API_PREFIX, dependencies=[ingest, Depends(reject_nul)], responses=errors
    )
    one_at_a_time = asyncio.Semaphore(1)

    @r.post(
        "/jobs/{job_id}/traces",
        response_model=m.TraceInfoPublic,
        status_code=201,
        tags=["traces"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "application/gzip": {"schema": {"type": "string", "format": "binary"}},
                },
            }
        },
    )
    async def upload_trace(
        request: Request,
        job_id: JobId,
        rank: Annotated[int | None, Query(ge=0, le=INT64)] = None,
        name: Annotated[str, Query(max_length=256)] = "",
    ) -> Response:
        """Upload a Kineto trace (JSON or gzip) for offline analysis."""
        async with one_at_a_time:
            body = await read_body(request, ctx.settings.max_trace_bytes)
            if body is None:
                raise HTTPException(
                    413, detail=f"trace exceeds {ctx.settings.max_trace_bytes} bytes"
                )
            try:
                parsed = await run_in_threadpool(
                    kineto.parse, body, max_bytes=ctx.settings.max_trace_bytes
                )
            except kineto.TraceError as exc:
                raise HTTPException(422, detail=str(exc)) from exc
            del body

            def save() -> dict[str, Any]:
                with ctx.store.write() as conn:
                    return kineto.store(
                        conn, parsed, job_id=job_id, rank=rank, name=name, now_s=ctx.clock()
                    )

            return json_response(await run_in_threadpool(save), status_code=201)

    return r
