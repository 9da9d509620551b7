"""Where the streaming analyzer plugs into the collector: the protocols it implements and the
runner that feeds it committed batches.

`StreamAnalyzer` (with `TickingAnalyzer` for silence and `ResumingAnalyzer` for a job's recent
past) is the whole contract; `vigil.analyzer.StreamingAnalyzer` implements it, `vigil collector`
(`collector/cli.py`) passes one to `create_app`, which wraps it in an `AnalyzerRunner`. The runner
calls it on one worker thread, in commit order, so an analyzer needs no locks and a slow one never
delays an acknowledgement; the findings it returns are upserted by id. A `MergingAnalyzer` is
handed the batches queued when the worker wakes as one call (`merge`; within its step span and
`MAX_MERGE_RECORDS`): a 10,000-rank job whose ranks ship their own batches then costs a few
calls per wake, not one per rank (a call costs ~1 ms at that size, whatever it carries). Must
not import the analyzer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
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


@runtime_checkable
class MergingAnalyzer(StreamAnalyzer, Protocol):
    """An analyzer that may see several committed batches as one `observe` call (their records
    and step columns concatenated in commit order), provided that per job their step records
    span at most `merge_steps` step numbers together."""

    merge_steps: int


# `history(job_id, steps)`: a job's Job and RankInfo records and its last `steps` steps' records
# (step records as columns, collective aggregates), read back from the store.
History = Callable[[str, int], tuple[Sequence[schema.Record], columns.StepColumns | None]]


@runtime_checkable
class DueAnalyzer(TickingAnalyzer, Protocol):
    """A ticking analyzer that says when its next tick could find something (a hang's silence
    passing its threshold): the collector ticks then too, not only every `analyzer_tick_s`."""

    def due_s(self) -> float | None: ...


@runtime_checkable
class ResumingAnalyzer(StreamAnalyzer, Protocol):
    """An analyzer that reads a job's recent past from the store when it first sees the job
    (after a collector restart, running jobs are picked up where they were)."""

    def use_history(self, history: History) -> None: ...


# A merged call holds at most this many records and step rows: a codec batch's own bound.
MAX_MERGE_RECORDS = 100_000


@dataclass(eq=False)
class _Queued:
    """One committed batch waiting for the analyzer: its size, its step records as columns
    (`step_columns`: `steps`, or built from `records` once, for a merge), and per job the
    (lowest, highest) step number of its step records, which bound what may be merged with it."""

    records: Sequence[schema.Record]
    steps: columns.StepColumns | None
    future: Future[None] = field(default_factory=Future)
    size: int = 0
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    step_columns: columns.StepColumns | None = None

    def __post_init__(self) -> None:
        self.size = len(self.records) + (0 if self.steps is None else len(self.steps))
        steps = self.steps
        if steps is None:
            found = [r for r in self.records if type(r) is schema.StepRecord]
            steps = columns.from_records(found) if found else None
        self.step_columns = steps
        if steps is not None and len(steps):
            jobs = steps.jobs()
            for job in jobs:
                numbers = (steps if len(jobs) == 1 else steps.of_job(job)).column("step")
                self.spans[job] = (int(numbers.min()), int(numbers.max()))


def widen(
    spans: dict[str, tuple[int, int]], more: dict[str, tuple[int, int]], limit: int
) -> dict[str, tuple[int, int]] | None:
    """`spans` grown by `more`; None when some job's span would exceed `limit` step numbers."""
    out = dict(spans)
    for job, (lo, hi) in more.items():
        had = out.get(job)
        if had is not None:
            lo, hi = min(lo, had[0]), max(hi, had[1])
        if hi - lo + 1 > limit:
            return None
        out[job] = (lo, hi)
    return out


def merge(
    batches: Sequence[tuple[Sequence[schema.Record], columns.StepColumns | None]],
) -> tuple[list[schema.Record], columns.StepColumns | None]:
    """Committed batches as one, in commit order: all records, and every batch's step records
    as columns (those that came as records of a batch without columns too; a batch's step
    records in `records` are ignored where it has columns, as `observe` does)."""
    records = list(chain.from_iterable(r for r, _ in batches))
    parts = []
    for recs, steps in batches:
        if steps is None:
            found = [r for r in recs if type(r) is schema.StepRecord]
            steps = columns.from_records(found) if found else None
        if steps is not None and len(steps):
            parts.append(steps)
    return records, columns.concat(parts) if parts else None


class AnalyzerRunner:
    """Feeds an analyzer on one thread and stores what it finds; counts its failures.

    The queue is bounded: past `max_pending` queued batches and ticks, or `max_pending_records`
    records in the queued batches, a batch is dropped (and counted through `on_drop`) rather
    than queued, so a slow analyzer never holds ingest's memory or time; a tick is skipped
    while another is still queued. A `MergingAnalyzer` sees the batches queued at each wake
    as one call (in commit order, at most `MAX_MERGE_RECORDS` records, within its
    `merge_steps`); the worker wakes again after any tick queued meanwhile, so a stream of
    batches never starves hang checks.
    """

    def __init__(
        self,
        analyzer: StreamAnalyzer,
        *,
        store_findings: Callable[[Sequence[schema.Finding]], None],
        on_error: Callable[[], None] = lambda: None,
        on_drop: Callable[[], None] = lambda: None,
        max_pending: int = 16_384,
        max_pending_records: int = 500_000,
    ) -> None:
        if max_pending < 1 or max_pending_records < 1:
            raise ValueError(
                f"max_pending and max_pending_records must be >= 1, got {max_pending} and "
                f"{max_pending_records}"
            )
        self.analyzer = analyzer
        self._store_findings = store_findings
        self._on_error = on_error
        self._on_drop = on_drop
        self._max_pending = max_pending
        self._max_records = max_pending_records
        self._records = 0  # records (and step rows) of the queued batches
        self._merge_steps = analyzer.merge_steps if isinstance(analyzer, MergingAnalyzer) else 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vigil-analyzer")
        self._pending = 0
        self._queue: deque[_Queued] = deque()
        self._wake_queued = False
        self._tick_queued = False
        self._closed = False
        self._lock = threading.Lock()
        self.calls = 0  # observe calls made (fewer than batches where batches were merged)
        # The analyzer's `due_s` after its latest call (read by the tick loop, set on the
        # worker thread, so the loop never reads the analyzer while it runs).
        self.due_s: float | None = None
        self._due = analyzer if isinstance(analyzer, DueAnalyzer) else None

    @property
    def pending(self) -> int:
        """Batches and ticks queued but not yet analysed."""
        return self._pending

    def submit(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Future[None] | None:
        """Queue one committed batch; its future is done once it was analysed; None when the
        queue was full and the batch was dropped."""
        queued = _Queued(records, steps)
        with self._lock:
            if self._closed:
                return None  # shutting down: nothing analyses it any more
            # One batch is always taken when nothing is queued, however large.
            if self._pending >= self._max_pending or (
                self._queue and self._records + queued.size > self._max_records
            ):
                self._on_drop()
                return None
            if not self._wake_queued:
                try:
                    self._executor.submit(self._wake)
                except RuntimeError:  # closed: shutting down, nothing analyses it any more
                    return None
                self._wake_queued = True
            self._pending += 1
            self._records += queued.size
            self._queue.append(queued)
        return queued.future

    def tick(self, now_s: float) -> Future[None] | None:
        analyzer = self.analyzer
        if not isinstance(analyzer, TickingAnalyzer):
            return None
        with self._lock:
            if self._tick_queued:
                return None
            if self._pending >= self._max_pending:
                self._on_drop()
                return None
            self._tick_queued = True
            self._pending += 1

        def call() -> None:
            self._tick_queued = False
            try:
                self._call(lambda: analyzer.tick(now_s))
            finally:
                with self._lock:
                    self._pending -= 1

        return self._executor.submit(call)

    def _take(self) -> list[_Queued]:
        """The batches for one call (the lock held): the oldest, and as many after it as the
        analyzer may see with it. Wakes again (behind any queued tick) if some are left."""
        if not self._queue:
            self._wake_queued = False
            return []
        first = self._queue.popleft()
        self._records -= first.size
        taken = [first]
        if self._merge_steps:
            size, spans = first.size, first.spans
            while self._queue and size + self._queue[0].size <= MAX_MERGE_RECORDS:
                grown = widen(spans, self._queue[0].spans, self._merge_steps)
                if grown is None:
                    break
                size, spans = size + self._queue[0].size, grown
                self._records -= self._queue[0].size
                taken.append(self._queue.popleft())
        try:
            if self._queue:
                self._executor.submit(self._wake)
            else:
                self._wake_queued = False
        except RuntimeError:  # closing: `close` drops what is left
            self._wake_queued = False
        return taken

    def _wake(self) -> None:
        with self._lock:
            taken = self._take()
        if not taken:
            return
        try:
            if len(taken) == 1:
                records, steps = taken[0].records, taken[0].steps
            else:
                records, steps = merge([(q.records, q.step_columns) for q in taken])
            self._call(lambda: self.analyzer.observe(records, steps))
        finally:
            with self._lock:
                self._pending -= len(taken)
            for q in taken:
                q.future.set_result(None)

    def _call(self, call: Callable[[], Sequence[schema.Finding]]) -> None:
        self.calls += 1
        try:
            findings = list(call())
            if self._due is not None:
                self.due_s = self._due.due_s()
            if findings:
                self._store_findings(findings)
        except Exception:  # an analyzer bug must never take ingest down
            log.exception("streaming analyzer failed; batch stays stored, findings skipped")
            self._on_error()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued work (bounded by `timeout_s`), then stop the worker; batches still
        queued then are dropped (their futures cancelled)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closed = True
        while True:
            done = threading.Event()
            self._executor.submit(done.set)
            finished = done.wait(max(deadline - time.monotonic(), 0.0))
            with self._lock:
                idle = not self._queue
            if idle or not finished:
                break
        if not idle:
            log.warning(
                "analyzer still busy after %.1f s at shutdown; dropping its queue", timeout_s
            )
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            left, self._queue = list(self._queue), deque()
            self._records = 0
        for q in left:
            q.future.cancel()
