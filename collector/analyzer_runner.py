"""Where the streaming analyzer plugs into the collector: the protocols it implements and the
runner that feeds it committed batches.

`StreamAnalyzer` (with `TickingAnalyzer` for silence and `ResumingAnalyzer` for a job's recent
past) is the whole contract; `vigil.analyzer.StreamingAnalyzer` implements it, `vigil collector`
(`collector/cli.py`) passes one to `create_app`, which wraps it in an `AnalyzerRunner`. The runner
calls it on one worker thread, in commit order, so an analyzer needs no locks and a slow one never
delays an acknowledgement; the findings it returns are upserted by id. Must not import the
analyzer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable

from vigil import columns, schema

log = logging.getLogger(__name__)


@runtime_checkable
class StreamAnalyzer(Protocol):
    """What the collector needs from a streaming analyzer."""

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        """See one committed batch (all record types; `steps`: its step records as columns,
        when the collector built them, and then the only source of step records: those that
        came as a columnar block are not in `records`); return findings to store."""
        ...


@runtime_checkable
class TickingAnalyzer(StreamAnalyzer, Protocol):
    """An analyzer that also detects silence (hangs) when no records arrive."""

    def tick(self, now_s: float) -> Sequence[schema.Finding]: ...


# `history(job_id, steps)`: a job's Job and RankInfo records and its last `steps` steps' records
# (step records as columns, collective aggregates), read back from the store.
History = Callable[[str, int], tuple[Sequence[schema.Record], columns.StepColumns | None]]


@runtime_checkable
class ResumingAnalyzer(StreamAnalyzer, Protocol):
    """An analyzer that reads a job's recent past from the store when it first sees the job
    (after a collector restart, running jobs are picked up where they were)."""

    def use_history(self, history: History) -> None: ...


class AnalyzerRunner:
    """Feeds an analyzer on one thread and stores what it finds; counts its failures.

    The queue is bounded: past `max_pending` queued calls a batch is dropped (and counted
    through `on_drop`) rather than queued, so a slow analyzer never holds ingest's memory or
    time; a tick is skipped while another is still queued.
    """

    def __init__(
        self,
        analyzer: StreamAnalyzer,
        *,
        store_findings: Callable[[Sequence[schema.Finding]], None],
        on_error: Callable[[], None] = lambda: None,
        on_drop: Callable[[], None] = lambda: None,
        max_pending: int = 1024,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.analyzer = analyzer
        self._store_findings = store_findings
        self._on_error = on_error
        self._on_drop = on_drop
        self._max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vigil-analyzer")
        self._pending = 0
        self._tick_queued = False
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Batches and ticks queued but not yet analysed."""
        return self._pending

    def submit(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Future[None] | None:
        """Queue one committed batch; None when the queue was full and the batch was dropped."""
        return self._submit(lambda: self.analyzer.observe(records, steps))

    def tick(self, now_s: float) -> Future[None] | None:
        analyzer = self.analyzer
        if not isinstance(analyzer, TickingAnalyzer):
            return None
        with self._lock:
            if self._tick_queued:
                return None
            self._tick_queued = True

        def call() -> Sequence[schema.Finding]:
            self._tick_queued = False
            return analyzer.tick(now_s)

        future = self._submit(call)
        if future is None:
            self._tick_queued = False
        return future

    def _submit(self, call: Callable[[], Sequence[schema.Finding]]) -> Future[None] | None:
        with self._lock:
            if self._pending >= self._max_pending:
                full = True
            else:
                full = False
                self._pending += 1
        if full:
            self._on_drop()
            return None
        return self._executor.submit(self._run, call)

    def _run(self, call: Callable[[], Sequence[schema.Finding]]) -> None:
        try:
            findings = list(call())
            if findings:
                self._store_findings(findings)
        except Exception:  # an analyzer bug must never take ingest down
            log.exception("streaming analyzer failed; batch stays stored, findings skipped")
            self._on_error()
        finally:
            with self._lock:
                self._pending -= 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued work (bounded by `timeout_s`), then stop the worker."""
        done = threading.Event()
        self._executor.submit(done.set)
        if not done.wait(timeout_s):
            log.warning(
                "analyzer still busy after %.1f s at shutdown; dropping its queue", timeout_s
            )
        self._executor.shutdown(wait=False, cancel_futures=True)
