"""POST /api/v1/ingest: decode, check, commit once, acknowledge, then hand to the analyzer.

Acknowledges (200) only after the batch's transaction committed; a batch id seen before is answered
200 with `duplicate: true` and stored nothing. Decode and validation problems are 4xx naming the
record type and field (senders never retry those); store trouble is 503 (senders retry).
POST /api/v1/ingest/frames takes several frames at once (a node agent's relay) and answers each
as a lone POST of it would have been, in one 200; its good frames are stored through one
`GroupCommit.ingest_all`, so they share transactions.
Must not block the event loop: decoding and writing run in the thread pool.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psycopg
from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import Response
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from starlette.concurrency import run_in_threadpool

from vigil import api, codec, schema
from vigil.collector import auth, validate
from vigil.collector.context import CollectorContext, json_response, read_body
from vigil.collector.models import ErrorPublic, FramesPublic, IngestPublic
from vigil.collector.store import IngestResult

log = logging.getLogger(__name__)
ACCEPTED_MEDIA_TYPES = {api.BATCH_MEDIA_TYPE, "application/octet-stream"}
RETRY_AFTER_S = "2"


@dataclass(frozen=True)
class _Answer:
    """What a lone POST of one frame is answered: status, JSON body, extra headers."""

    status: int
    body: dict[str, object]
    headers: Mapping[str, str] | None = None

    def response(self) -> Response:
        response = json_response(self.body, status_code=self.status)
        response.headers.update(self.headers or {})
        return response


def _refuse(
    ctx: CollectorContext,
    code: int,
    reason: str,
    detail: str,
    headers: Mapping[str, str] | None = None,
) -> _Answer:
    ctx.metrics.rejected_batches.labels(reason=reason).inc()
    return _Answer(code, {"detail": detail}, headers)


def _error(
    ctx: CollectorContext,
    code: int,
    reason: str,
    detail: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return _refuse(ctx, code, reason, detail, headers).response()


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
) -> _Answer:
    """A value the store refused before the checks reached it (e.g. an integer the driver
    cannot send): name the record and field when the checks can, else say the store refused."""
    try:
        for cls, group in checked.groups.items():
            validate.verify_group(cls, group, checked.rows.get(cls), checked.steps)
    except codec.DecodeError as found:
        return _refuse(ctx, 422, "decode", str(found))
    log.error("store refused batch %s: %s", batch.batch_id, exc)
    detail = f"Batch.<store>: the store refused a value in this batch ({type(exc).__name__})"
    return _refuse(ctx, 422, "store", detail)


def _binary_body(media_type: str) -> dict[str, object]:
    """The OpenAPI request body of a route that takes opaque bytes of `media_type`."""
    content = {media_type: {"schema": {"type": "string", "format": "binary"}}}
    return {"requestBody": {"required": True, "content": content}}


def router(ctx: CollectorContext) -> APIRouter:
    check = auth.require(auth.Scope.INGEST, ctx.settings)
    routes = APIRouter(tags=["ingest"])
    errors: dict[int | str, dict[str, object]] = {
        code: {"model": ErrorPublic} for code in (401, 403, 413, 415, 422, 503)
    }

    async def _body(request: Request, media_types: set[str], wanted: str) -> bytes | Response:
        """The request's body once it passed auth, media type and size, else the answer."""
        try:
            check(request)
        except HTTPException as exc:
            return _error(ctx, exc.status_code, "auth", str(exc.detail), exc.headers)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media not in media_types:
            return _error(ctx, 415, "decode", f"Batch.<frame>: content type must be {wanted}")
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
        return body

    @routes.post(
        api.INGEST_PATH,
        response_model=IngestPublic,
        responses=errors,
        openapi_extra=_binary_body(api.BATCH_MEDIA_TYPE),
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
        body = await _body(request, ACCEPTED_MEDIA_TYPES, api.BATCH_MEDIA_TYPE)
        if isinstance(body, Response):
            return body
        header_id = request.headers.get(api.BATCH_ID_HEADER)
        return await run_in_threadpool(_commit_guarded, ctx, body, header_id)

    @routes.post(
        api.INGEST_FRAMES_PATH,
        response_model=FramesPublic,
        responses=errors,
        openapi_extra=_binary_body(api.FRAMES_MEDIA_TYPE),
    )
    async def ingest_frames(request: Request) -> Response:
        """Store several batches at once (`vigil.codec.encode_frames`: a node agent relaying
        its ranks' frames), each exactly once, in one transaction where they can share one.

        200 with one result per frame, in order: the status and body a lone POST of that frame
        to the ingest path would have had (a frame refused does not fail the others). The
        whole body is bounded as one batch is (VIGIL_MAX_BATCH_BYTES; inflated, all frames
        together, VIGIL_MAX_BATCH_INFLATED_BYTES), at most 4,096 frames; a body that is not a
        frames envelope is a 422, one past a bound a 413."""
        body = await _body(request, {api.FRAMES_MEDIA_TYPE}, api.FRAMES_MEDIA_TYPE)
        if isinstance(body, Response):
            return body
        return await run_in_threadpool(_commit_frames_guarded, ctx, body)

    return routes


# Batches that inflate past 1 MiB (or do not say) decode and store two at a time: each may hold
# tens of MB of inflated bytes and decoded records, and the thread pool would otherwise run
# dozens at once (small frames can inflate a thousandfold).
_LARGE_BYTES = 1 << 20
_LARGE_AT_ONCE = threading.BoundedSemaphore(2)
# Frames in one envelope: a node's ranks for a few flushes, with room to spare.
MAX_FRAMES = 4096


def _guarded(
    ctx: CollectorContext, size: int, inflated: int, commit: Callable[[], Response]
) -> Response:
    """`commit()`, answering a bug with a 500 here, in the worker thread: an exception that
    travelled on through the thread pool and the middleware would keep its frames (and the
    batch they hold) alive in reference cycles until a full garbage collection."""
    try:
        if inflated < 0 or inflated > _LARGE_BYTES:
            with _LARGE_AT_ONCE:
                return commit()
        return commit()
    except Exception as exc:
        log.error("ingest failed on a %d-byte body: %s", size, exc, exc_info=exc)
        # A log handler may keep the record (and its traceback): the frames' locals go now.
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        return _error(
            ctx,
            500,
            "internal",
            "Batch.<collector>: internal error while storing this batch (logged); retry later",
        )


def _commit_guarded(ctx: CollectorContext, body: bytes, header_id: str | None) -> Response:
    return _guarded(
        ctx, len(body), codec.inflated_size(body), lambda: _commit(ctx, body, header_id)
    )


def _commit_frames_guarded(ctx: CollectorContext, body: bytes) -> Response:
    try:
        frames = codec.split_frames(body, max_frames=MAX_FRAMES)
    except codec.DecodeError as exc:
        too_many = "limit" in exc.problem
        return _error(
            ctx, 413 if too_many else 422, "too_large" if too_many else "decode", str(exc)
        )
    limit = ctx.settings.max_batch_inflated_bytes
    # A frame that does not say how far it inflates may inflate to the limit (one that is not
    # a frame is refused before anything inflates).
    inflated = sum(_inflates_to(frame, limit) for frame in frames)
    if len(frames) > 1 and inflated > limit:
        return _error(
            ctx,
            413,
            "too_large",
            f"Frames.<frames>: the frames inflate to {inflated} bytes together, past the "
            f"{limit} byte limit: send fewer per request",
        )
    return _guarded(ctx, len(body), inflated, lambda: _commit_frames(ctx, frames))


def _inflates_to(frame: bytes, limit: int) -> int:
    size = codec.inflated_size(frame)
    if size >= 0:
        return size
    return limit if frame.startswith(codec.MAGIC) else len(frame)


def _decoded(
    ctx: CollectorContext, body: bytes, header_id: str | None
) -> tuple[schema.Batch, validate.Checked] | _Answer:
    """One frame decoded and checked, or the answer that refuses it."""
    try:
        batch, checked = _decode(ctx, body)
    except codec.DecodeError as exc:
        too_large = "limit" in exc.problem and exc.field in ("<frame>", "records")
        return _refuse(
            ctx, 413 if too_large else 422, "too_large" if too_large else "decode", str(exc)
        )
    if header_id and header_id != batch.batch_id:
        return _refuse(
            ctx,
            422,
            "decode",
            f"Batch.batch_id: header {api.BATCH_ID_HEADER} {header_id!r} does not match the "
            f"frame's {batch.batch_id!r}",
        )
    return batch, checked


def _settled(
    ctx: CollectorContext,
    batch: schema.Batch,
    checked: validate.Checked,
    outcome: IngestResult | BaseException,
    started: float,
) -> _Answer:
    """The answer to one batch the store took or refused (`outcome`); hands what it
    committed to the analyzer. Raises what no answer names (a bug: a 500)."""
    if isinstance(outcome, codec.DecodeError):  # a record the store cannot hold; none stored
        return _refuse(ctx, 422, "decode", str(outcome))
    if isinstance(outcome, _STORE_REFUSED):
        return _refused(ctx, batch, checked, outcome)
    if isinstance(outcome, _STORE_AWAY):  # locked, down: the sender retries
        log.warning("store unavailable for batch %s: %s", batch.batch_id, outcome)
        detail = f"Batch.<store>: store busy or unavailable, retry ({type(outcome).__name__})"
        return _refuse(ctx, 503, "store", detail, {"Retry-After": RETRY_AFTER_S})
    if isinstance(outcome, BaseException):
        raise outcome
    ctx.metrics.batch_latency.observe(time.perf_counter() - started)
    if outcome.duplicate:
        ctx.metrics.batches.labels(outcome="duplicate").inc()
    else:
        ctx.metrics.batches.labels(outcome="committed").inc()
        for record_type, count in outcome.counts.items():
            ctx.metrics.ingested_rows.labels(type=record_type).inc(count)
        if ctx.runner is not None:
            ctx.runner.submit(batch.records, outcome.steps)
    return _Answer(
        200,
        {
            "batch_id": outcome.batch_id,
            "accepted": outcome.accepted,
            "duplicate": outcome.duplicate,
        },
    )


_STORE_REFUSED = (
    DataError,
    IntegrityError,
    OverflowError,
    psycopg.DataError,
    psycopg.IntegrityError,
)
_STORE_AWAY = (DBAPIError, TimeoutError, psycopg.Error)


def _commit(ctx: CollectorContext, body: bytes, header_id: str | None) -> Response:
    started = time.perf_counter()
    found = _decoded(ctx, body, header_id)
    if isinstance(found, _Answer):
        return found.response()
    batch, checked = found
    (outcome,) = ctx.commits.ingest_all([(batch, checked)])
    return _settled(ctx, batch, checked, outcome, started).response()


def _commit_frames(ctx: CollectorContext, frames: list[bytes]) -> Response:
    """Each frame decoded and checked, the good ones stored together, one answer each."""
    started = time.perf_counter()
    answers: list[_Answer | None] = []
    good: list[tuple[int, schema.Batch, validate.Checked]] = []
    for i, frame in enumerate(frames):
        found = _decoded(ctx, frame, None)
        if isinstance(found, _Answer):
            answers.append(found)
        else:
            answers.append(None)
            good.append((i, *found))
    outcomes = ctx.commits.ingest_all([(batch, checked) for _, batch, checked in good])
    for (i, batch, checked), outcome in zip(good, outcomes, strict=True):
        answers[i] = _settled(ctx, batch, checked, outcome, started)
    return json_response(
        {"results": [{"status": a.status, **a.body} for a in answers if a is not None]}
    )
