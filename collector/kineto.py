"""Uploaded Kineto (PyTorch profiler) traces: validated, compressed, stored for offline analysis.

A trace is JSON with a `traceEvents` list, optionally gzip-compressed as the profiler writes
`*.pt.trace.json.gz`. Inflation is bounded by the same limit as the upload. Checking costs no
more memory than the inflated bytes: the JSON is validated without building its events, and
events are counted by their `"ph"` keys (every trace event has one). Must not interpret the
events: the analyzer's importers do that.
"""

from __future__ import annotations

import re
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import msgspec
import zstandard
from sqlalchemy import select
from sqlalchemy.engine import Connection

from vigil.collector import tables

GZIP_MAGIC = b"\x1f\x8b"


class TraceError(ValueError):
    """An upload that is not a Kineto/Chrome trace; the message says what is wrong."""


@dataclass(frozen=True, kw_only=True)
class ParsedTrace:
    raw_json: bytes
    num_events: int


class _Trace(msgspec.Struct):
    """A trace document with its events left undecoded (validated, not built)."""

    traceEvents: msgspec.Raw  # noqa: N815 (Kineto's key)


_trace_decoder = msgspec.json.Decoder(_Trace)
_PHASE_KEY = re.compile(rb'"ph"\s*:')
_NOT_A_TRACE = "trace must be a JSON object with a 'traceEvents' list (Kineto format)"


def parse(body: bytes, *, max_bytes: int) -> ParsedTrace:
    """Check an upload is a trace (gzip or plain JSON with a traceEvents list)."""
    if body[:2] == GZIP_MAGIC:
        body = _gunzip(body, max_bytes)
    if len(body) > max_bytes:
        raise TraceError(f"trace is {len(body)} bytes, over the {max_bytes} byte limit")
    try:
        events = _trace_decoder.decode(body).traceEvents
    except msgspec.ValidationError as exc:
        raise TraceError(_NOT_A_TRACE) from exc
    except msgspec.DecodeError as exc:
        raise TraceError(f"trace is not valid JSON: {exc}") from exc
    if not bytes(memoryview(events)[:1]).startswith(b"["):
        raise TraceError(_NOT_A_TRACE)
    count = sum(1 for _ in _PHASE_KEY.finditer(body))
    return ParsedTrace(raw_json=body, num_events=count)


def _gunzip(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise TraceError(f"corrupt gzip data: {exc}") from exc
    if len(out) > limit:
        raise TraceError(f"trace inflates beyond the {limit} byte limit")
    return out


def store(
    conn: Connection, trace: ParsedTrace, *, job_id: str, rank: int | None, name: str, now_s: float
) -> dict[str, Any]:
    row = {
        "trace_id": uuid.uuid4().hex,
        "job_id": job_id,
        "rank": rank,
        "name": name,
        "uploaded_s": now_s,
        "num_bytes": len(trace.raw_json),
        "num_events": trace.num_events,
    }
    content = zstandard.ZstdCompressor(level=3).compress(trace.raw_json)
    conn.execute(tables.traces.insert().values(**row, content=content))
    return row


def list_traces(conn: Connection, job_id: str) -> list[dict[str, Any]]:
    t = tables.traces
    query = select(*(c for c in t.columns if c.name != "content")).where(t.c.job_id == job_id)
    return [dict(r) for r in conn.execute(query.order_by(t.c.uploaded_s.desc())).mappings()]


def load(conn: Connection, trace_id: str) -> bytes | None:
    """The trace's JSON bytes as uploaded (inflated), or None if unknown."""
    t = tables.traces
    blob = conn.execute(select(t.c.content).where(t.c.trace_id == trace_id)).scalar_one_or_none()
    return None if blob is None else zstandard.ZstdDecompressor().decompress(blob)
