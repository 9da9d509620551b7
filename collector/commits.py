"""Group commit: ingest requests that arrive while a transaction is being written share the next.

Every rank's SDK ships its own batch each flush, so a large job's collector receives many small
batches at once; each in its own transaction pays the transaction's fixed cost (statements, the
heatmap's read-modify-write, SQLite's fsync) for a few records. `GroupCommit.ingest` queues a
request's batch; whichever waiting request finds no transaction in progress writes everything
queued then (`Store.ingest_many`, at most `MAX_GROUP_RECORDS` records) and hands each request its
own result. A lone request is written at once, as before. A group the store refuses (a bad value
in one batch) is written again batch by batch, so only that batch fails; a store that is down or
busy fails every batch of the group, and their senders retry. `VIGIL_INGEST_GROUP_COMMIT=0`
writes each batch alone. Threads only; no I/O of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import psycopg
from sqlalchemy.exc import DataError, IntegrityError

from vigil import codec, schema
from vigil.collector import validate
from vigil.collector.store import IngestResult, Store, mergeable

# A group holds at most this many records (a codec batch's own bound): one transaction stays
# as large as the largest single batch.
MAX_GROUP_RECORDS = 100_000
# What a batch's own values can make the store refuse; a group refused so is retried per batch.
REFUSED = (
    codec.DecodeError,
    DataError,
    IntegrityError,
    OverflowError,
    psycopg.DataError,
    psycopg.IntegrityError,
)


@dataclass(eq=False)
class _Pending:
    batch: schema.Batch
    checked: validate.Checked
    result: IngestResult | None = None
    error: BaseException | None = None
    done: bool = False

    @property
    def outcome(self) -> IngestResult | BaseException:
        """Once done: the batch's result, or what the store raised for it."""
        if self.error is not None:
            return self.error
        assert self.result is not None, "a settled batch has a result or an error"
        return self.result


class GroupCommit:
    """Shares transactions among concurrent ingest requests (see the module docstring)."""

    def __init__(self, store: Store, *, grouped: bool = True) -> None:
        self.store = store
        self.grouped = grouped  # False: each batch in its own transaction, as it arrives
        self._queue: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._writing = threading.Lock()  # held by the request writing a group
        self.transactions = 0  # groups written (fewer than batches under concurrent load)

    def ingest(self, batch: schema.Batch, checked: validate.Checked) -> IngestResult:
        """Store one batch exactly once, possibly in one transaction with others; raises what
        `Store.ingest` raises for it."""
        (outcome,) = self.ingest_all([(batch, checked)])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def ingest_all(
        self, items: list[tuple[schema.Batch, validate.Checked]]
    ) -> list[IngestResult | BaseException]:
        """Store several batches (one request of a relay), each exactly once, sharing groups
        as `ingest` does; per batch its result or what the store raised for it."""
        if not self.grouped:
            out: list[IngestResult | BaseException] = []
            for batch, checked in items:
                self.transactions += 1
                try:
                    out.append(self.store.ingest(batch, checked))
                except Exception as exc:
                    out.append(exc)
            return out
        mine = [_Pending(batch, checked) for batch, checked in items]
        self._settle(mine)
        return [p.outcome for p in mine]

    def _settle(self, mine: list[_Pending]) -> None:
        """Queue `mine`; write groups (or wait while another request does) until all are done."""
        if not mine:
            return
        with self._cond:
            self._queue.extend(mine)
        while True:
            if self._writing.acquire(blocking=False):
                try:
                    self._write(self._take())
                finally:
                    self._writing.release()
                    with self._cond:
                        self._cond.notify_all()
            with self._cond:
                if not all(p.done for p in mine) and self._writing.locked():
                    self._cond.wait(0.05)  # a group is being written: it may hold these batches
                if all(p.done for p in mine):
                    break

    def _take(self) -> list[_Pending]:
        """What is queued (in arrival order, within `MAX_GROUP_RECORDS`; at least one)."""
        with self._cond:
            taken: list[_Pending] = []
            size = 0
            while self._queue and (
                not taken or size + self._queue[0].checked.count <= MAX_GROUP_RECORDS
            ):
                item = self._queue.popleft()
                size += item.checked.count
                taken.append(item)
            return taken

    def _write(self, taken: list[_Pending]) -> None:
        """Write a group and settle each of its requests; never raises."""
        if not taken:
            return
        together = [p for p in taken if mergeable(p.checked)]
        alone = [[p] for p in taken if not mergeable(p.checked)]
        for group in ([together] if together else []) + alone:
            self.transactions += 1
            try:
                results = self.store.ingest_many([(p.batch, p.checked) for p in group])
                for p, result in zip(group, results, strict=True):
                    p.result = result
            except REFUSED as exc:
                if len(group) == 1:
                    group[0].error = exc
                else:  # find the batch the store refuses: each in its own transaction
                    for p in group:
                        self._write_alone(p)
            except BaseException as exc:  # the store is down or busy: the senders retry
                for p in group:
                    p.error = exc
        with self._cond:
            for p in taken:
                p.done = True

    def _write_alone(self, p: _Pending) -> None:
        self.transactions += 1
        try:
            p.result = self.store.ingest(p.batch, p.checked)
        except BaseException as exc:
            p.error = exc
