"""POST /api/v1/ingest: decode, check, commit once, acknowledge, then hand to the analyzer.

Acknowledges (200) only after the batch's transaction committed; a batch id seen before is answered
200 with `duplicate: true` and stored nothing. Decode and validation problems are 4xx naming the
record type and field (senders never retry those); store trouble is 503 (senders retry).
Must not block the event loop: decoding and writing run in the thread pool.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Mapping

import psycopg
from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import Response
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from starlette.concurrency import run_in_threadpool

from vigil import api, codec, schema
from vigil.collector import auth, validate
from vigil.collector.context import CollectorContext, json_response, read_body
from vigil.collector.models import ErrorPublic, IngestPublic

log = logging.getLogger(__name__)
ACCEPTED_MEDIA_TYPES = {api.BATCH_MEDIA_TYPE, "application/octet-stream"}
RETRY_AFTER_S = "2"


def _error(
    ctx: CollectorContext,
    code: int,
    reason: str,
    detail: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    ctx.metrics.rejected_batches.labels(reason=reason).inc()
    response = json_response({"detail": detail}, status_code=code)
    response.headers.update(headers or {})
    return response


def _decode(ctx: CollectorContext, body: bytes) -> tuple[schema.Batch, validate.Checked]:
    batch, steps = codec.decode_frame(
        body,
        max_bytes=ctx.settings.max_batch_bytes,
        max_decompressed_bytes=ctx.settings.max_batch_inflated_bytes,
        max_records=ctx.settings.max_batch_records,
    )
    validate.check_envelope(batch)
    # Values are checked inside the store's transaction (step records while the database
    # digests them); ranks against their jobs' world sizes here.
    checked = validate.prepare_batch(batch.records, steps)
    declared = validate.declared_world_sizes(checked)
    # Names the store cannot hold are refused with the values (NUL characters), not looked up.
    jobs = validate.ranked_jobs(checked) | set(declared)
    storable = {job for job in jobs if job and "\x00" not in job}
    world = ctx.world_sizes.lookup(storable, {j: declared[j] for j in storable if j in declared})
    validate.check_world(checked, world, ctx.settings.max_world_size)
    return batch, checked


def _refused(
    ctx: CollectorContext, batch: schema.Batch, checked: validate.Checked, exc: Exception
) -> Response:
    """A value the store refused before the checks reached it (e.g. an integer the driver
    cannot send): name the record and field when the checks can, else say the store refused."""
    try:
        for cls, group in checked.groups.items():
            validate.verify_group(cls, group, checked.rows.get(cls), checked.steps)
    except codec.DecodeError as found:
        return _error(ctx, 422, "decode", str(found))
    log.error("store refused batch %s: %s", batch.batch_id, exc)
    detail = f"Batch.<store>: the store refused a value in this batch ({type(exc).__name__})"
    return _error(ctx, 422, "store", detail)


def router(ctx: CollectorContext) -> APIRouter:
    check = auth.require(auth.Scope.INGEST, ctx.settings)
    routes = APIRouter(tags=["ingest"])
    errors: dict[int | str, dict[str, object]] = {
        code: {"model": ErrorPublic} for code in (401, 403, 413, 415, 422, 503)
    }

    @routes.post(
        api.INGEST_PATH,
        response_model=IngestPublic,
        responses=errors,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    api.BATCH_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def ingest(request: Request) -> Response:
        """Store one batch framed by `vigil.codec.encode_batch`, exactly once.

        Bounds (settings): the body at most VIGIL_MAX_BATCH_BYTES (32 MiB), inflated at most
        VIGIL_MAX_BATCH_INFLATED_BYTES (64 MiB), at most VIGIL_MAX_BATCH_RECORDS records
        (100,000); names 1-256 characters, other strings at most 256, a finding's summary, an
        evidence note and an action's result at most 4,096; a finding's subjects at most 4,096
        of each kind and at most 64 evidence entries; ranks below their job's declared world
        size (at most VIGIL_MAX_WORLD_SIZE, 131,072, also for jobs that declared none); step
        numbers below 2**53. Anything past a bound is a 413 or 422 naming the field."""
        try:
            check(request)
        except HTTPException as exc:
            return _error(ctx, exc.status_code, "auth", str(exc.detail), exc.headers)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media not in ACCEPTED_MEDIA_TYPES:
            return _error(
                ctx, 415, "decode", f"Batch.<frame>: content type must be {api.BATCH_MEDIA_TYPE}"
            )
        header_id = request.headers.get(api.BATCH_ID_HEADER)
        # Duplicates are found inside the batch's own transaction (see Store.ingest): a lookup
        # before reading the body would cost every fresh batch a round trip to spare the rare
        # retried one a decode.
        body = await read_body(request, ctx.settings.max_batch_bytes)
        if body is None:
            return _error(
                ctx,
                status.HTTP_413_CONTENT_TOO_LARGE,
                "too_large",
                f"Batch.<frame>: body exceeds the {ctx.settings.max_batch_bytes} byte limit",
            )
        return await run_in_threadpool(_commit_guarded, ctx, body, header_id)

    return routes


# Batches that inflate past 1 MiB (or do not say) decode and store two at a time: each may hold
# tens of MB of inflated bytes and decoded records, and the thread pool would otherwise run
# dozens at once (small frames can inflate a thousandfold).
_LARGE_BYTES = 1 << 20
_LARGE_AT_ONCE = threading.BoundedSemaphore(2)


def _commit_guarded(ctx: CollectorContext, body: bytes, header_id: str | None) -> Response:
    """`_commit`, answering a bug with a 500 here, in the worker thread: an exception that
    travelled on through the thread pool and the middleware would keep its frames (and the
    batch they hold) alive in reference cycles until a full garbage collection."""
    try:
        inflated = codec.inflated_size(body)
        if inflated < 0 or inflated > _LARGE_BYTES:
            with _LARGE_AT_ONCE:
                return _commit(ctx, body, header_id)
        return _commit(ctx, body, header_id)
    except Exception as exc:
        log.error("ingest failed on a %d-byte batch: %s", len(body), exc, exc_info=exc)
        # A log handler may keep the record (and its traceback): the frames' locals go now.
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        return _error(
            ctx,
            500,
            "internal",
            "Batch.<collector>: internal error while storing this batch (logged); retry later",
        )


def _commit(ctx: CollectorContext, body: bytes, header_id: str | None) -> Response:
    started = time.perf_counter()
    try:
        batch, checked = _decode(ctx, body)
    except codec.DecodeError as exc:
        too_large = "limit" in exc.problem and exc.field in ("<frame>", "records")
        return _error(
            ctx, 413 if too_large else 422, "too_large" if too_large else "decode", str(exc)
        )
    if header_id and header_id != batch.batch_id:
        return _error(
            ctx,
            422,
            "decode",
            f"Batch.batch_id: header {api.BATCH_ID_HEADER} {header_id!r} does not match the "
            f"frame's {batch.batch_id!r}",
        )
    try:
        result = ctx.commits.ingest(batch, checked)
    except codec.DecodeError as exc:  # a record the store cannot hold; nothing was committed
        return _error(ctx, 422, "decode", str(exc))
    except (
        DataError,
        IntegrityError,
        OverflowError,
        psycopg.DataError,
        psycopg.IntegrityError,
    ) as exc:
        return _refused(ctx, batch, checked, exc)
    except (DBAPIError, TimeoutError, psycopg.Error) as exc:  # locked, down: the sender retries
        log.warning("store unavailable for batch %s: %s", batch.batch_id, exc)
        detail = f"Batch.<store>: store busy or unavailable, retry ({type(exc).__name__})"
        response = _error(ctx, 503, "store", detail)
        response.headers["Retry-After"] = RETRY_AFTER_S
        return response
    ctx.metrics.batch_latency.observe(time.perf_counter() - started)
    if result.duplicate:
        ctx.metrics.batches.labels(outcome="duplicate").inc()
    else:
        ctx.metrics.batches.labels(outcome="committed").inc()
        for record_type, count in result.counts.items():
            ctx.metrics.ingested_rows.labels(type=record_type).inc(count)
        if ctx.runner is not None:
            ctx.runner.submit(batch.records, result.steps)
    return json_response(
        {"batch_id": result.batch_id, "accepted": result.accepted, "duplicate": result.duplicate}
    )
