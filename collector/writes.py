"""Turns one decoded batch into rows and writes them inside the caller's transaction.

High-volume records (step records, collective aggregates and events, heartbeats, samples) go
through `dialects.bulk_write` (executemany on SQLite, COPY on PostgreSQL); the rest are upserted
by their ids with SQLAlchemy Core. Must not commit, decode or call the analyzer.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from sqlalchemy import Table
from sqlalchemy.engine import Connection

from vigil import columns, schema
from vigil.collector import dialects, pgcopy, step_matrix, tables, validate

# Bulk rows are the records' own field tuples (msgspec.structs.astuple: 3x cheaper than reading
# attributes by name), so column lists follow the wire field order. A new wire field needs a
# migration adding its column (tests/collector/test_store.py checks the two agree).
as_row = msgspec.structs.astuple
STEP_COLUMNS = step_matrix.STEP_COLUMNS
AGG_COLUMNS = step_matrix.struct_columns(schema.CollectiveAggregate)
EVENT_COLUMNS = [*step_matrix.struct_columns(schema.CollectiveEvent), "received_s"]
SAMPLE_COLUMNS = [*step_matrix.struct_columns(schema.Sample), "received_s"]
HEARTBEAT_COLUMNS = [c.name for c in tables.heartbeats.columns if c.name != "id"]
BULK_TABLES = {
    tables.step_records.name: STEP_COLUMNS,
    tables.coll_aggs.name: AGG_COLUMNS,
    tables.coll_events.name: EVENT_COLUMNS,
    tables.samples.name: SAMPLE_COLUMNS,
}


@dataclass(frozen=True, kw_only=True)
class Written:
    """How many records of each wire type (`step`, `sample`, ...) a batch held, and its step
    records as columns (when it had any)."""

    counts: dict[str, int]
    steps: columns.StepColumns | None
    listed_jobs: frozenset[str] = frozenset()  # jobs that now have a jobs row


def write_records(
    conn: Connection,
    records: Sequence[schema.Record],
    *,
    received_s: float,
    checked: validate.Checked | None = None,
    listed: Container[str] = frozenset(),
) -> Written:
    """Store every record of one batch (the caller's transaction makes it all-or-nothing).
    `checked`: `validate.check_batch(records)` or `validate.prepare_batch(records)`, whose
    groups and tuples are reused (and which carry the batch's columnar step records, if any);
    an unverified batch is verified here, group by group, and a `DecodeError` aborts the write
    (step records are verified while the database digests them). `listed`: jobs known to have
    a jobs row already (no placeholder is written for them)."""
    if checked is None:
        checked = validate.prepare_batch(records)
    elif sum(map(len, checked.groups.values())) != len(records):
        raise ValueError("checked groups do not hold these records")
    steps = checked.steps
    for record_type, group in checked.groups.items():
        rows = checked.rows.get(record_type)
        if record_type is schema.StepRecord:
            steps = _steps(conn, group, checked, verify=not checked.verified)
            continue
        if not checked.verified:
            validate.verify_group(record_type, group, rows)
        _WRITERS[record_type](conn, group, received_s, rows)
    jobs = _placeholder_jobs(conn, checked, received_s, listed)
    return Written(counts=counts(checked), steps=steps, listed_jobs=jobs)


def counts(checked: validate.Checked) -> dict[str, int]:
    """How many records of each wire type (`step`, `sample`, ...) a batch holds."""
    found = {_TAGS[t]: len(g) for t, g in checked.groups.items()}
    if schema.StepRecord in checked.groups:  # block rows have no record objects
        found[_TAGS[schema.StepRecord]] = checked.step_count
    return found


Rows = list[tuple[Any, ...]] | None
_JOB_ID = operator.attrgetter("job_id")


def _tuples(records: list[Any], rows: Rows) -> list[tuple[Any, ...]]:
    return list(map(as_row, records)) if rows is None else rows


def _steps(
    conn: Connection, records: list[schema.StepRecord], checked: validate.Checked, *, verify: bool
) -> columns.StepColumns:
    """Bulk-write step records and patch their heatmap cells; returns their columns. With
    `verify`, the records are verified first thing in the bulk write's idle slot (PostgreSQL:
    while it digests the COPY), and a bad one aborts the write. Block rows go to PostgreSQL as
    a binary COPY stream laid out from their columns, with no tuple per row."""
    steps = checked.steps
    postgres = conn.dialect.name == dialects.POSTGRESQL
    block = checked.block if postgres else None
    rows: list[tuple[Any, ...]] | None = None if block is not None else checked.step_rows()
    prepared: list[step_matrix.Prepared] = []
    if verify and not postgres:  # no idle slot: verify up front
        steps, verify = validate.verify_group(schema.StepRecord, records, rows, steps), False

    def meanwhile() -> None:
        cols = steps
        if verify:
            cols = validate.verify_group(schema.StepRecord, records, rows, steps)
        prepared.append(step_matrix.prepare(conn, rows, cols))

    dialects.bulk_write(
        conn,
        tables.step_records,
        STEP_COLUMNS,
        rows if rows is not None else checked.step_rows,
        upsert_rows=True,
        meanwhile=meanwhile,
        encoded=None if block is None else (lambda: step_copy(block)),
    )
    step_matrix.apply(conn, prepared[0])
    return prepared[0].steps


_STEP_TYPES = dialects.copy_types(tables.step_records, STEP_COLUMNS)


def step_copy(cols: columns.StepColumns) -> bytes:
    """Step records (columns carrying their loss) as PostgreSQL's binary COPY stream of
    `STEP_COLUMNS`; an unknown loss (NaN) is NULL."""
    if cols.loss is None:
        raise ValueError("step columns without their loss cannot be copied")
    values: list[pgcopy.Column] = []
    nulls: list[npt.NDArray[np.bool_] | None] = []
    for name in STEP_COLUMNS:
        if name == "job_id":
            values.append(cols.job_ids)
            nulls.append(None)
        elif name == "loss":
            values.append(cols.loss)
            nulls.append(np.isnan(cols.loss))
        else:
            values.append(cols.column(name))
            nulls.append(None)
    return pgcopy.encode(_STEP_TYPES, values, nulls)


def _aggs(
    conn: Connection, records: list[schema.CollectiveAggregate], received_s: float, rows: Rows
) -> None:
    tuples = _tuples(records, rows)
    dialects.bulk_write(conn, tables.coll_aggs, AGG_COLUMNS, tuples, upsert_rows=True)


def _events(
    conn: Connection, records: list[schema.CollectiveEvent], received_s: float, rows: Rows
) -> None:
    tuples = [(*r, received_s) for r in _tuples(records, rows)]
    dialects.bulk_write(conn, tables.coll_events, EVENT_COLUMNS, tuples, upsert_rows=True)


def _heartbeats(
    conn: Connection, records: list[schema.Heartbeat], received_s: float, rows: Rows
) -> None:
    tuples = [
        (
            r.job_id,
            r.rank,
            r.time_s,
            r.last_step,
            r.last_group,
            r.last_seq,
            r.last_op,
            r.state.value,
            received_s,
        )
        for r in records
    ]
    dialects.bulk_write(conn, tables.heartbeats, HEARTBEAT_COLUMNS, tuples, upsert_rows=False)


def _samples(conn: Connection, records: list[schema.Sample], received_s: float, rows: Rows) -> None:
    tuples = [(*r, received_s) for r in _tuples(records, rows)]
    dialects.bulk_write(conn, tables.samples, SAMPLE_COLUMNS, tuples, upsert_rows=False)


def _as_row(record: msgspec.Struct, **extra: Any) -> dict[str, Any]:
    """A record's fields as builtins (enums to values, nested structs to dicts)."""
    row: dict[str, Any] = msgspec.to_builtins(msgspec.structs.asdict(record))
    row.update(extra)
    return row


def _jobs(conn: Connection, records: list[schema.Job], received_s: float, rows: Rows) -> None:
    dicts = [_as_row(r, updated_s=received_s) for r in records]
    for row in dicts:
        row.setdefault("model", None)
    dialects.upsert(conn, tables.jobs, dicts)


def _placeholder_jobs(
    conn: Connection, checked: validate.Checked, received_s: float, listed: Container[str]
) -> frozenset[str]:
    """A jobs row (world size 0: not declared yet) for every job the batch reports on without
    a Job record and not `listed` yet, so a job known only from its ranks' records is listed;
    its Job record, when it comes, replaces the row. Returns the batch's jobs that have a row."""
    described = set(map(_JOB_ID, checked.groups.get(schema.Job, ())))
    jobs: set[str] = set()
    if checked.block is not None:
        jobs |= checked.block.jobs()
    for cls in (schema.StepRecord, schema.RankInfo, schema.Heartbeat):
        jobs.update(map(_JOB_ID, checked.groups.get(cls, ())))
    missing = [j for j in jobs if j not in listed and j not in described]
    if not missing:
        return frozenset(jobs | described)
    placeholder = {
        "name": "",
        "world_size": 0,
        "layout": {},
        "model": None,
        "device_kind": "",
        "peak_flops": 0.0,
        "state": str(schema.JobState.RUNNING),
        "created_s": received_s,
        "updated_s": received_s,
    }
    rows = [{"job_id": j, **placeholder} for j in sorted(missing)]
    dialects.insert_missing(conn, tables.jobs, rows)
    return frozenset(jobs | described)


def _upserter(table: Table) -> Callable[[Connection, list[Any], float, Rows], None]:
    def write(conn: Connection, records: list[Any], received_s: float, rows: Rows) -> None:
        dialects.upsert(conn, table, [_as_row(r) for r in records])

    return write


def _diags(
    conn: Connection, records: list[schema.DiagResult], received_s: float, rows: Rows
) -> None:
    conn.execute(tables.diag_results.insert(), [_as_row(r) for r in records])


_WRITERS: dict[type, Callable[[Connection, list[Any], float, Rows], None]] = {
    schema.CollectiveAggregate: _aggs,
    schema.CollectiveEvent: _events,
    schema.Heartbeat: _heartbeats,
    schema.Sample: _samples,
    schema.Job: _jobs,
    schema.RankInfo: _upserter(tables.ranks),
    schema.Finding: _upserter(tables.findings),
    schema.Action: _upserter(tables.actions),
    schema.Checkpoint: _upserter(tables.checkpoints),
    schema.DiagResult: _diags,
}
# Step records go through `_steps` (their columns and checks travel with them).
assert {schema.StepRecord, *_WRITERS} == set(schema.RECORD_TYPES), "every record type is written"
_TAGS: dict[type, str] = {cls: tag for tag, cls in schema.RECORD_TAGS.items()}
