"""A small collector stand-in following the ingest contract in docs/architecture.md (tests).

POST `vigil.api.INGEST_PATH` with a codec frame: 200 + {"batch_id", "accepted", "duplicate"} once
committed (a repeated batch id is stored once); 400 {"detail": "<Type>.<field>: <problem>"} for a
frame that does not decode; 401 without the expected bearer token; 503 for the first
`fail_first` requests (a collector that is starting up); `answer(batch)` may pick another status
for a decoded batch (a collector failing on one batch). Real HTTP on loopback, in a thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vigil import api, codec, schema


class Receiver:
    def __init__(
        self,
        port: int = 0,
        *,
        token: str | None = None,
        fail_first: int = 0,
        answer: Callable[[schema.Batch], int | None] | None = None,
    ) -> None:
        self.token = token
        self.fail_first = fail_first
        self.answer = answer
        self.answered: list[tuple[str, int]] = []  # (batch id, status) of every decoded batch
        self.requests = 0
        self.batch_ids: list[str] = []
        self.records: list[schema.Record] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver._handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        body = request.rfile.read(int(request.headers.get("Content-Length", "0")))
        with self._lock:
            self.requests += 1
            if request.path != api.INGEST_PATH:
                return _reply(request, 404, {"detail": f"no route {request.path}"})
            if self.requests <= self.fail_first:
                return _reply(request, 503, {"detail": "starting up"})
            if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
                return _reply(request, 401, {"detail": "missing or wrong bearer token"})
            try:
                batch = codec.decode_batch(body)
            except codec.DecodeError as exc:
                return _reply(request, 400, {"detail": str(exc)})
            status = self.answer(batch) if self.answer else None
            self.answered.append((batch.batch_id, status or 200))
            if status is not None:
                return _reply(request, status, {"detail": f"answered {status} by the test"})
            duplicate = batch.batch_id in self.batch_ids
            if not duplicate:
                self.batch_ids.append(batch.batch_id)
                self.records.extend(batch.records)
            _reply(
                request,
                200,
                {
                    "batch_id": batch.batch_id,
                    "accepted": len(batch.records),
                    "duplicate": duplicate,
                },
            )

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _reply(request: BaseHTTPRequestHandler, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    request.send_response(status)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(data)))
    request.end_headers()
    request.wfile.write(data)
