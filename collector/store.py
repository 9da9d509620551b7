"""The collector's store: an engine on SQLite (WAL) or PostgreSQL (psycopg 3), migrated at open.

`Store.ingest` commits one batch and its batch id in one transaction, so a batch is either fully
stored once or not at all; the caller acknowledges only after it returns. Reads live in `queries`.
Must not decode frames or call the analyzer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, select, text
from sqlalchemy.engine import Connection, Engine, make_url

from vigil import columns, schema
from vigil.collector import dialects, migrate, queries, tables, validate, writes

log = logging.getLogger(__name__)

# A writer waits this long for SQLite's lock or a PostgreSQL row lock before giving up (-> 503).
LOCK_TIMEOUT_S = 30.0
# PostgreSQL statements longer than this are cancelled: no request may hold a connection forever.
STATEMENT_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """How to open a store. `url` is a SQLAlchemy URL (sqlite:///path or postgresql+psycopg://)."""

    url: str
    # FULL: an acknowledged batch survives power loss, not only a crash (WAL fsyncs each commit).
    sqlite_synchronous: str = "FULL"
    pool_size: int = 8

    def __post_init__(self) -> None:
        if not self.url.startswith(("sqlite://", "postgresql+psycopg://")):
            raise ValueError(
                f"store URL {self.url!r}: use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
            )
        if self.sqlite_synchronous not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(
                f"sqlite_synchronous {self.sqlite_synchronous!r} is not OFF, NORMAL, FULL or EXTRA"
            )
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")


@dataclass(frozen=True, kw_only=True)
class IngestResult:
    batch_id: str
    accepted: int
    duplicate: bool
    counts: dict[str, int] = field(default_factory=dict)
    steps: columns.StepColumns | None = None  # the batch's step records as columns


_MAX_LISTED_JOBS = 65_536


class Store:
    """One database behind the collector; thread-safe (FastAPI runs handlers in a pool)."""

    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.engine = _create_engine(config)
        self.dialect = self.engine.dialect.name
        # SQLite allows one writer; serialising here avoids SQLITE_BUSY retries under load.
        self._write_lock = threading.Lock() if self.dialect == dialects.SQLITE else None
        # Jobs known to have a jobs row (committed): their batches write no placeholder row.
        self._listed_jobs: set[str] = set()

    def migrate(self) -> str:
        return migrate.upgrade(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction (committed on exit, rolled back on error)."""
        if self._write_lock is not None and not self._write_lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise TimeoutError(f"no SQLite write slot within {LOCK_TIMEOUT_S} s")
        try:
            with self.engine.begin() as conn:
                yield conn
        finally:
            if self._write_lock is not None:
                self._write_lock.release()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def batch_seen(self, batch_id: str) -> int | None:
        """How many records a committed batch held, or None if it was never committed."""
        with self.read() as conn:
            return conn.execute(
                select(tables.batches.c.num_records).where(tables.batches.c.batch_id == batch_id)
            ).scalar_one_or_none()

    def ingest(self, batch: schema.Batch, checked: validate.Checked | None = None) -> IngestResult:
        """Store a decoded batch exactly once; a batch id seen before is a no-op duplicate.
        `checked`: `validate.check_batch` or `validate.prepare_batch` of `batch.records` (and of
        the batch's columnar step records, which only `checked` carries), reused rather than
        rebuilt; an unverified batch is verified inside the transaction, so a bad
        record raises `DecodeError` and nothing is stored."""
        received_s = self.clock()
        count = len(batch.records) if checked is None else checked.count
        with self.write() as conn:
            fresh = dialects.insert_ignore(
                conn,
                tables.batches,
                {
                    "batch_id": batch.batch_id,
                    "received_s": received_s,
                    "num_records": count,
                    "source": batch.source,
                },
            )
            written = (
                writes.write_records(
                    conn,
                    batch.records,
                    received_s=received_s,
                    checked=checked,
                    listed=self._listed_jobs,
                )
                if fresh
                else None
            )
        if written is None:
            return IngestResult(batch_id=batch.batch_id, accepted=count, duplicate=True)
        if len(self._listed_jobs) > _MAX_LISTED_JOBS:  # bounded: forgetting costs one insert
            self._listed_jobs.clear()
        self._listed_jobs.update(written.listed_jobs)
        return IngestResult(
            batch_id=batch.batch_id,
            accepted=count,
            duplicate=False,
            counts=written.counts,
            steps=written.steps,
        )

    def ingest_many(
        self, items: Sequence[tuple[schema.Batch, validate.Checked]]
    ) -> list[IngestResult]:
        """Store several decoded batches in one transaction, each exactly once (a batch id seen
        before, or earlier in `items`, is a duplicate), their records written together. All
        or nothing: a record the store refuses in any of them raises and nothing is stored
        (`GroupCommit` then stores them one by one). Each batch's `checked` must come from
        `validate.prepare_batch` and hold its step records in one form (`mergeable`)."""
        if len(items) == 1:
            return [self.ingest(*items[0])]
        unmergeable = [b.batch_id for b, c in items if not mergeable(c)]
        if unmergeable:
            raise ValueError(f"batches {unmergeable} carry step records as records and a block")
        received_s = self.clock()
        with self.write() as conn:
            fresh = [
                dialects.insert_ignore(
                    conn,
                    tables.batches,
                    {
                        "batch_id": batch.batch_id,
                        "received_s": received_s,
                        "num_records": checked.count,
                        "source": batch.source,
                    },
                )
                for batch, checked in items
            ]
            kept = [item for item, new in zip(items, fresh, strict=True) if new]
            written = None
            if kept:
                records = list(chain.from_iterable(batch.records for batch, _ in kept))
                blocks = [c.block for _, c in kept if c.block is not None and len(c.block)]
                union = validate.prepare_batch(records, columns.concat(blocks) if blocks else None)
                written = writes.write_records(
                    conn, records, received_s=received_s, checked=union, listed=self._listed_jobs
                )
        if written is not None:
            if len(self._listed_jobs) > _MAX_LISTED_JOBS:
                self._listed_jobs.clear()
            self._listed_jobs.update(written.listed_jobs)
        return [
            IngestResult(
                batch_id=batch.batch_id,
                accepted=checked.count,
                duplicate=not new,
                counts=writes.counts(checked) if new else {},
                steps=_step_columns(checked) if new else None,
            )
            for (batch, checked), new in zip(items, fresh, strict=True)
        ]

    def world_sizes(self, job_ids: list[str]) -> dict[str, int]:
        """Declared world sizes of `job_ids` (jobs never declared are left out)."""
        with self.read() as conn:
            return queries.world_sizes(conn, job_ids)

    def store_findings(self, findings: Sequence[schema.Finding]) -> None:
        """Upsert findings by id (the analyzer's output)."""
        if findings:
            with self.write() as conn:
                writes.write_records(conn, findings, received_s=self.clock())

    def size_bytes(self) -> int:
        """Bytes the store occupies on disk (database file + WAL, or the PostgreSQL database)."""
        if self.dialect == dialects.POSTGRESQL:
            with self.read() as conn:
                return int(
                    conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
                )
        path = make_url(self.config.url).database or ""
        return sum(
            os.path.getsize(p) for p in (path, f"{path}-wal", f"{path}-shm") if os.path.exists(p)
        )


def mergeable(checked: validate.Checked) -> bool:
    """Whether a prepared batch can be written together with others: its step records are
    all records or all in its block (a batch with both keeps the block's rows among its
    tuples only, which `ingest_many` does not rebuild)."""
    return len(checked.rows.get(schema.StepRecord, ())) == len(
        checked.groups.get(schema.StepRecord, ())
    )


def _step_columns(checked: validate.Checked) -> columns.StepColumns | None:
    """A batch's step records as columns, as `ingest` returns them (None: it had none)."""
    if checked.steps is not None:
        return checked.steps
    rows = checked.rows.get(schema.StepRecord)
    return columns.from_rows(rows) if rows else None


def _create_engine(config: StoreConfig) -> Engine:
    url = make_url(config.url)
    if url.get_backend_name() == dialects.SQLITE:
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"timeout": LOCK_TIMEOUT_S, "check_same_thread": False},
            pool_size=config.pool_size,
        )
        event.listen(engine, "connect", _sqlite_pragmas(config.sqlite_synchronous))
        return engine
    timeout_ms = int(STATEMENT_TIMEOUT_S * 1000)
    return create_engine(
        url,
        pool_size=config.pool_size,
        pool_pre_ping=True,
        pool_timeout=LOCK_TIMEOUT_S,
        connect_args={
            "connect_timeout": 10,
            "options": f"-c statement_timeout={timeout_ms} "
            f"-c lock_timeout={int(LOCK_TIMEOUT_S * 1000)}",
        },
    )


def _sqlite_pragmas(synchronous: str) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # WAL: readers never block the writer, and a crash loses no committed transaction.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return on_connect
