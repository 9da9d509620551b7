"""What every request handler shares: settings, store, metrics, analyzer runner, clock.

Built once by `create_app` and attached to `app.state`; handlers receive it through closures, never
through module globals. Must not open anything itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request, Response

from vigil.collector.analyzer_runner import AnalyzerRunner
from vigil.collector.commits import GroupCommit
from vigil.collector.metrics import CollectorMetrics
from vigil.collector.settings import CollectorSettings
from vigil.collector.store import Store
from vigil.collector.world import WorldSizes

_encoder = msgspec.json.Encoder()


@dataclass(kw_only=True)
class CollectorContext:
    settings: CollectorSettings
    store: Store
    metrics: CollectorMetrics
    clock: Callable[[], float]
    world_sizes: WorldSizes
    commits: GroupCommit
    runner: AnalyzerRunner | None = None


def json_response(body: Any, status_code: int = 200) -> Response:
    """Encode with msgspec: fast for large matrices, and NaN/inf become null (valid JSON)."""
    return Response(_encoder.encode(body), status_code=status_code, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it grows past `limit` bytes (read no further)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
