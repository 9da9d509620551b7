"""Where records go: JSON lines on disk, or the collector (through the core `outbox.Outbox`).

A `Sink` is written to only by a background thread (`Flusher`), never by training code. The
`Flusher` drains a bounded in-memory queue the hooks append to (a deque: appends never block,
and past its bound the oldest records fall out and are counted as dropped), and runs a periodic
callback (heartbeats, hang suspicion) once per interval.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from vigil import codec, schema

log = logging.getLogger(__name__)


class Sink(Protocol):
    def write(self, records: Sequence[schema.Record]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends records as JSON lines (`vigil.codec.encode_json`) to one file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the session

    def write(self, records: Sequence[schema.Record]) -> None:
        if records:
            self._file.write(codec.encode_json_lines(records))
            self._file.flush()

    def close(self) -> None:
        self._file.close()


class TeeSink:
    """Writes every record to each of its sinks in turn (the collector and a local JSONL copy);
    one sink failing does not keep records from the others."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def write(self, records: Sequence[schema.Record]) -> None:
        failure: Exception | None = None
        for sink in self.sinks:
            try:
                sink.write(records)
            except Exception as exc:  # the flusher counts it; the other sinks still get them
                failure = exc
        if failure is not None:
            raise failure

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class RecordQueue:
    """A bounded, non-blocking queue of records; overflow drops the oldest and counts them."""

    def __init__(self, max_records: int) -> None:
        self._items: collections.deque[schema.Record] = collections.deque(maxlen=max_records)
        self._lock = threading.Lock()
        self.dropped = 0

    def put(self, record: schema.Record) -> None:
        with self._lock:
            if len(self._items) == self._items.maxlen:
                self.dropped += 1
            self._items.append(record)

    def extend(self, records: Sequence[schema.Record]) -> None:
        for record in records:
            self.put(record)

    def drain(self) -> list[schema.Record]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)


class Flusher:
    """Background thread: every `interval_s` runs `tick()`, then writes queued records to `sink`."""

    def __init__(
        self,
        *,
        queue: RecordQueue,
        sink: Sink,
        interval_s: float,
        tick: Callable[[], None],
        on_error: Callable[[BaseException], None],
        name: str = "vigil-flusher",
    ) -> None:
        self._queue = queue
        self._sink = sink
        self._interval_s = interval_s
        self._tick = tick
        self._on_error = on_error
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def flush_soon(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            self._once()

    def _once(self) -> None:
        try:
            self._tick()
        except Exception as exc:
            self._on_error(exc)
        try:
            self._sink.write(self._queue.drain())
        except Exception as exc:
            self._on_error(exc)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop the thread, write what is queued and close the sink."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("vigil flusher did not stop within %.0f s", timeout_s)
        try:
            self._sink.write(self._queue.drain())
        except Exception as exc:
            self._on_error(exc)
        finally:
            self._sink.close()
