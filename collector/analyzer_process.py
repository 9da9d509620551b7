"""The streaming analyzer in a child process at low CPU priority (how `vigil collector` runs it).

In-process, the analyzer's thread and the ingest threads share one GIL: analysing a batch
delays the next acknowledgement by as long as the analysis takes. In a child process at the
lowest CPU priority (nice 19) the analyzer uses only CPU that ingest leaves idle (ingest waits on
the database for much of each batch), and never holds a lock an acknowledgement needs.

`ProcessAnalyzer` implements `hook.TickingAnalyzer` plus `observe_frame`: batches travel as the
frames the collector received and already validated (no re-encoding); findings come back framed
by `vigil.codec`. Calls block the runner's worker thread (never an ingest thread) until the
child answers. If the child dies it is restarted with fresh state (logged; the next batches
rebuild the windows) and the failed call raises, which the runner counts as an analyzer error.
Must not import the analyzer: `factory` (e.g. `vigil.analyzer.StreamingAnalyzer`) is imported by
reference in the child.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import struct
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from vigil import codec, columns, schema

log = logging.getLogger(__name__)

_FRAME, _RECORDS, _TICK = b"F", b"R", b"T"
_TICK_FORMAT = struct.Struct("<d")
START_TIMEOUT_S = 60.0
_NO_LIMIT = 1 << 40


class AnalyzerProcessError(RuntimeError):
    """The child process failed or died; it has been restarted."""


def _child(conn: Connection, factory: Callable[[], Any]) -> None:
    """The child's loop: one answer (a findings frame, or an error line) per request."""
    with contextlib.suppress(OSError):
        os.nice(19)  # only CPU the collector leaves idle
    analyzer = factory()
    conn.send_bytes(b"ready")
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        kind, body = message[:1], message[1:]
        try:
            if kind == _TICK:
                findings = analyzer.tick(_TICK_FORMAT.unpack(body)[0])
            else:
                # The collector decoded and checked this frame against its own limits already.
                records = codec.decode_batch(
                    body,
                    max_bytes=len(body),
                    max_decompressed_bytes=_NO_LIMIT,
                    max_records=_NO_LIMIT,
                ).records
                if kind == _FRAME:
                    steps = [r for r in records if type(r) is schema.StepRecord]
                    findings = analyzer.observe(records, columns.from_records(steps))
                else:
                    findings = analyzer.observe(records)
            conn.send_bytes(b"+" + codec.encode_batch(list(findings), compress=False))
        except Exception as exc:  # reported to the parent, which counts it; the loop goes on
            conn.send_bytes(b"-" + f"{type(exc).__name__}: {exc}".encode())


class ProcessAnalyzer:
    """A streaming analyzer running in a child process; see the module docstring."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._lock = threading.Lock()  # one request in flight
        self._conn: Connection | None = None
        self._process: Any = None
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded server
        parent, child = context.Pipe()
        process = context.Process(
            target=_child, args=(child, self._factory), name="vigil-analyzer", daemon=True
        )
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S) or parent.recv_bytes() != b"ready":
            process.kill()
            raise AnalyzerProcessError(f"analyzer process did not start in {START_TIMEOUT_S} s")
        self._conn, self._process = parent, process
        log.info("streaming analyzer running in process %d (nice 19)", process.pid)

    def _call(self, message: bytes) -> list[schema.Finding]:
        with self._lock:
            conn = self._conn
            try:
                if conn is None:
                    raise EOFError("no analyzer process")
                conn.send_bytes(message)
                answer = conn.recv_bytes()
            except (EOFError, OSError, BrokenPipeError) as exc:
                self._restart(exc)
                raise AnalyzerProcessError(f"analyzer process died ({exc}); restarted") from exc
        if answer[:1] == b"-":
            raise AnalyzerProcessError(answer[1:].decode(errors="replace"))
        return [r for r in codec.decode_batch(answer[1:]).records if isinstance(r, schema.Finding)]

    def _restart(self, reason: BaseException) -> None:
        log.error("analyzer process lost (%s); starting a fresh one", reason)
        self._stop_child()
        try:
            self._start()
        except Exception:
            log.exception("analyzer process could not be restarted")
            self._conn = None

    def observe_frame(self, frame: bytes) -> Sequence[schema.Finding]:
        """See one committed batch as the frame it arrived in (already decoded and checked)."""
        return self._call(_FRAME + frame)

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        return self._call(_RECORDS + codec.encode_batch(list(records), compress=False))

    def tick(self, now_s: float) -> Sequence[schema.Finding]:
        return self._call(_TICK + _TICK_FORMAT.pack(now_s))

    @property
    def pid(self) -> int | None:
        return None if self._process is None else int(self._process.pid)

    def _stop_child(self) -> None:
        conn, process = self._conn, self._process
        self._conn = self._process = None
        if conn is not None:
            conn.close()  # the child's recv ends: it returns
        if process is not None:
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)

    def close(self) -> None:
        with self._lock:
            self._stop_child()
