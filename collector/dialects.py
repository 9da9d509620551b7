"""Dialect-specific SQL the bulk paths need: upserts, ignore-on-conflict inserts, COPY.

SQLite and PostgreSQL both speak `INSERT ... ON CONFLICT`; only PostgreSQL has COPY. Everything
here takes an open SQLAlchemy connection inside the caller's transaction and never commits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import psycopg
from sqlalchemy import BigInteger, Boolean, Double, Integer, LargeBinary, String, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

POSTGRESQL = "postgresql"
SQLITE = "sqlite"


def primary_key(table: Table) -> list[str]:
    return [c.name for c in table.primary_key.columns]


def dedupe(table: Table, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Last write wins within one batch (PostgreSQL refuses to upsert one key twice)."""
    key = primary_key(table)
    return list({tuple(row[k] for k in key): row for row in rows}.values())


def dedupe_tuples(
    table: Table, columns: Sequence[str], rows: Sequence[tuple[Any, ...]]
) -> list[tuple[Any, ...]]:
    """Like `dedupe` for tuples laid out as `columns` (which must include the primary key)."""
    key = itemgetter(*(list(columns).index(k) for k in primary_key(table)))
    return list({key(row): row for row in rows}.values())


def upsert(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """Insert `rows`, replacing every non-key column of rows whose primary key exists."""
    if not rows:
        return
    conn.execute(_upsert_statement(conn.dialect.name, table), dedupe(table, rows))


@functools.cache
def _upsert_statement(dialect: str, table: Table) -> Any:
    """`upsert`'s statement, built once per table (building it costs more than a small write)."""
    key = primary_key(table)
    stmt: Any = (postgresql if dialect == POSTGRESQL else sqlite).insert(table)
    return stmt.on_conflict_do_update(
        index_elements=key,
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in key},
    )


def insert_ignore(conn: Connection, table: Table, row: dict[str, Any]) -> bool:
    """Insert one row unless its primary key exists; True when it was inserted."""
    return conn.execute(_insert_ignore_statement(conn.dialect.name, table), row).first() is not None


@functools.cache
def _insert_ignore_statement(dialect: str, table: Table) -> Any:
    stmt: Any = (postgresql if dialect == POSTGRESQL else sqlite).insert(table)
    # RETURNING rather than rowcount: drivers do not all report rowcount for INSERT.
    return stmt.on_conflict_do_nothing().returning(table.primary_key.columns.values()[0])


def insert_missing(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """Insert the rows whose primary key is not there yet; leave the others as they are."""
    insert = postgresql.insert if conn.dialect.name == POSTGRESQL else sqlite.insert
    conn.execute(insert(table).on_conflict_do_nothing(), list(rows))


def _quote(conn: Connection, name: str) -> str:
    return str(conn.dialect.identifier_preparer.quote(name))


def upsert_sql(conn: Connection, table: Table, columns: Sequence[str], source: str) -> str:
    """`INSERT INTO table (columns) <source> ON CONFLICT (pk) DO UPDATE SET ...` as text."""
    key = primary_key(table)
    cols = ", ".join(_quote(conn, c) for c in columns)
    updates = ", ".join(
        f"{_quote(conn, c)} = excluded.{_quote(conn, c)}" for c in columns if c not in key
    )
    conflict = ", ".join(_quote(conn, c) for c in key)
    action = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
    into = f"INSERT INTO {_quote(conn, table.name)} ({cols})"
    return f"{into} {source} ON CONFLICT ({conflict}) {action}"


Rows = Sequence[tuple[Any, ...]]


def bulk_write(
    conn: Connection,
    table: Table,
    columns: Sequence[str],
    rows: Rows | Callable[[], Rows],
    *,
    upsert_rows: bool,
    meanwhile: Callable[[], None] | None = None,
    encoded: Callable[[], bytes] | None = None,
) -> None:
    """Write many tuples: executemany on SQLite, COPY on PostgreSQL. With `upsert_rows`, a row
    whose key exists replaces it. `meanwhile` is CPU work the caller needs done anyway: it runs
    once, while PostgreSQL digests the COPY stream (on SQLite, after the insert). `encoded`:
    the same rows as a whole binary COPY stream (`pgcopy`), which PostgreSQL then gets instead
    of formatting tuples; `rows` may then be a callable, called only if tuples are needed."""
    if encoded is None or conn.dialect.name != POSTGRESQL:
        rows = rows() if callable(rows) else rows
        encoded = None
        if not rows:
            if meanwhile is not None:
                meanwhile()
            return
    if conn.dialect.name != POSTGRESQL:  # SQLite upserts row by row: a repeated key just wins
        assert not callable(rows)
        _sqlite_write(conn, table, columns, rows, upsert_rows=upsert_rows)
        if meanwhile is not None:
            meanwhile()
    elif not upsert_rows:
        _copy(conn, table, table.name, columns, _Source(rows, encoded), _Once(meanwhile))
    else:
        _pg_upsert(conn, table, columns, _Source(rows, encoded), _Once(meanwhile))


class _Source:
    """What a COPY sends: pre-encoded bytes when there are, else the tuples."""

    def __init__(self, rows: Rows | Callable[[], Rows], encoded: Callable[[], bytes] | None):
        self._rows = rows
        self.encoded = encoded

    def rows(self) -> Rows:
        if callable(self._rows):
            self._rows = self._rows()
        return self._rows


class _Once:
    """Runs a callable on the first call only (the staging retry must not run it again)."""

    def __init__(self, work: Callable[[], None] | None) -> None:
        self.work = work

    def __call__(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work()


def _sqlite_write(
    conn: Connection,
    table: Table,
    columns: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
    *,
    upsert_rows: bool,
) -> None:
    key = (table, tuple(columns), upsert_rows)
    sql = _SQLITE_WRITES.get(key)
    if sql is None:  # built once per table and column list: building costs more than a small write
        values = f"VALUES ({', '.join('?' for _ in columns)})"
        cols = ", ".join(_quote(conn, c) for c in columns)
        sql = _SQLITE_WRITES[key] = (
            upsert_sql(conn, table, columns, values)
            if upsert_rows
            else f"INSERT INTO {_quote(conn, table.name)} ({cols}) {values}"
        )
    conn.exec_driver_sql(sql, list(rows))


_SQLITE_WRITES: dict[tuple[Table, tuple[str, ...], bool], str] = {}


def _pg_upsert(
    conn: Connection,
    table: Table,
    columns: Sequence[str],
    source: _Source,
    meanwhile: _Once,
) -> None:
    try:
        # Optimistic: rows are almost always new (a step re-run after a restart is the exception),
        # so COPY straight into the table; on a key clash, undo and take the staging path.
        with conn.begin_nested():
            _copy(conn, table, table.name, columns, source, meanwhile)
        return
    except psycopg.errors.UniqueViolation:
        pass
    rows = dedupe_tuples(table, columns, source.rows())  # ON CONFLICT may touch each key once
    stage = f"_stage_{table.name}"
    conn.exec_driver_sql(
        f"CREATE TEMP TABLE IF NOT EXISTS {stage} "
        f"(LIKE {_quote(conn, table.name)} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
    )
    _copy(conn, table, stage, columns, _Source(rows, None), meanwhile)
    cols = ", ".join(_quote(conn, c) for c in columns)
    order = ", ".join(_quote(conn, c) for c in primary_key(table))
    # Ordered by key so concurrent batches lock shared rows in one order (no deadlock).
    staged = f"SELECT {cols} FROM {stage} ORDER BY {order}"
    conn.exec_driver_sql(upsert_sql(conn, table, columns, staged))
    conn.exec_driver_sql(f"TRUNCATE {stage}")


def copy_types(table: Table, columns: Sequence[str]) -> list[str]:
    """PostgreSQL type names of `columns`, for binary COPY (3x cheaper than text COPY)."""
    names = []
    for column in columns:
        kind = table.c[column].type
        for python_type, pg_name in _PG_TYPES:
            if isinstance(kind, python_type):
                names.append(pg_name)
                break
        else:
            raise TypeError(f"no COPY type for {table.name}.{column} ({kind!r})")
    return names


def _copy(
    conn: Connection,
    table: Table,
    target: str,
    columns: Sequence[str],
    source: _Source,
    meanwhile: _Once | None = None,
) -> None:
    driver = conn.connection.driver_connection
    assert driver is not None
    cols = ", ".join(_quote(conn, c) for c in columns)
    sql = f"COPY {target} ({cols}) FROM STDIN (FORMAT BINARY)"
    with driver.cursor() as cursor, cursor.copy(sql) as copy:
        if source.encoded is not None:
            copy.write(source.encoded())
        else:
            copy.set_types(copy_types(table, columns))
            for row in source.rows():
                copy.write_row(row)
        # All but the last buffer is on its way: the server inserts while this runs.
        if meanwhile is not None:
            meanwhile()


# Order matters: BigInteger is an Integer, Text is a String.
_PG_TYPES: tuple[tuple[type, str], ...] = (
    (BigInteger, "int8"),
    (Integer, "int4"),
    (Double, "float8"),
    (Boolean, "bool"),
    (LargeBinary, "bytea"),
    (String, "text"),
)
