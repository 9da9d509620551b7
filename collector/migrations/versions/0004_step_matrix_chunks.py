"""Store the step matrices in chunks of 1,024 ranks: key (job_id, step, chunk).

One record of rank 131,071 made each of its step's arrays 1 MiB per metric (an array reached
from rank 0 to the largest rank). Now a row holds one chunk, chunk = rank // 1024, indexed by
rank % 1024, and exists only where one of its ranks reported. Upgrade splits each wider array
into its chunks, skipping chunks without a value and trimming trailing missing cells (as the
ingest path writes them); arrays of at most 1,024 ranks become chunk 0 in the server. Downgrade
joins a step's chunks into one array again. Both rebuild the table, then (PostgreSQL) keep the
arrays' `STORAGE EXTERNAL` of revision 0002. Self-contained: must not import vigil, whose
layout may move on.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 09:30:00
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHUNK_RANKS = 1024
_METRICS = ("step_time", "comm_wait", "mfu")
_PAGE = 16  # steps converted per round trip: at most 16 x 3 x 2 MiB of arrays in memory
_OLD = "step_matrix_0003"
_NEW = "step_matrix_0004"


def _columns(*, chunked: bool) -> list[sa.Column[Any]]:
    key = [sa.Column("chunk", sa.Integer(), autoincrement=False, nullable=False)] if chunked else []
    return [
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        *key,
        *(sa.Column(m, sa.LargeBinary(), nullable=False) for m in _METRICS),
    ]


def _table(name: str, *, chunked: bool) -> sa.TableClause:
    return sa.table(name, *(sa.column(c.name) for c in _columns(chunked=chunked)))


def _set_aside(name: str) -> None:
    """Rename step_matrix to `name` (its primary key too, whose name PostgreSQL keeps)."""
    op.rename_table("step_matrix", name)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {name} RENAME CONSTRAINT step_matrix_pkey TO {name}_pkey")


def _create(*, chunked: bool) -> None:
    key = ["job_id", "step", "chunk"] if chunked else ["job_id", "step"]
    op.create_table("step_matrix", *_columns(chunked=chunked), sa.PrimaryKeyConstraint(*key))
    if op.get_bind().dialect.name == "postgresql":  # as 0002: packed floats do not compress
        alters = ", ".join(f"ALTER COLUMN {m} SET STORAGE EXTERNAL" for m in _METRICS)
        op.execute(f"ALTER TABLE step_matrix {alters}")


def _pages(query: sa.Select[Any], *keys: sa.ColumnElement[Any]) -> Iterator[list[tuple[Any, ...]]]:
    """`query`'s rows in pages of `_PAGE`, by `keys` (keyset pagination: no cursor stays open
    while the caller writes)."""
    last: tuple[Any, ...] | None = None
    while True:
        page = query.order_by(*keys).limit(_PAGE)
        if last is not None:
            page = page.where(sa.tuple_(*keys) > sa.tuple_(*last))
        rows = [tuple(row) for row in op.get_bind().execute(page)]
        if not rows:
            return
        yield rows
        last = rows[-1][: len(keys)]


def _arrays(blobs: Sequence[bytes]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """One step's metric arrays as a (metric, rank) matrix, NaN-padded to the widest."""
    width = max(len(b) for b in blobs) // 8
    grid = np.full((len(blobs), width), np.nan, dtype="<f8")
    for m, blob in enumerate(blobs):
        grid[m, : len(blob) // 8] = np.frombuffer(blob, dtype="<f8")
    return grid


def split(job_id: str, step: int, blobs: Sequence[bytes]) -> list[dict[str, Any]]:
    """Pure: one step's arrays as chunk rows; chunks without a value are left out and each
    chunk's trailing missing cells are trimmed."""
    grid = _arrays(blobs)
    rows = []
    for chunk, first in enumerate(range(0, grid.shape[1], CHUNK_RANKS)):
        part = grid[:, first : first + CHUNK_RANKS]
        present = np.flatnonzero(~np.isnan(part).all(axis=0))
        if len(present):
            cells = part[:, : int(present[-1]) + 1]
            values = {m: cells[i].tobytes() for i, m in enumerate(_METRICS)}
            rows.append({"job_id": job_id, "step": step, "chunk": chunk, **values})
    return rows


def join(job_id: str, step: int, chunks: Sequence[tuple[int, Sequence[bytes]]]) -> dict[str, Any]:
    """Pure: one step's chunk rows `(chunk, blobs)` as one array per metric indexed by rank."""
    parts = [(chunk, _arrays(blobs)) for chunk, blobs in chunks]
    width = max(chunk * CHUNK_RANKS + part.shape[1] for chunk, part in parts)
    grid = np.full((len(_METRICS), width), np.nan, dtype="<f8")
    for chunk, part in parts:
        grid[:, chunk * CHUNK_RANKS : chunk * CHUNK_RANKS + part.shape[1]] = part
    return {
        "job_id": job_id,
        "step": step,
        **{m: grid[i].tobytes() for i, m in enumerate(_METRICS)},
    }


def _narrow(table: sa.TableClause) -> sa.ColumnElement[bool]:
    """The rows of `table` whose arrays hold at most one chunk."""
    return sa.and_(*(sa.func.length(table.c[m]) <= CHUNK_RANKS * 8 for m in _METRICS))


def upgrade() -> None:
    _set_aside(_OLD)
    _create(chunked=True)
    old, target = _table(_OLD, chunked=False), _table("step_matrix", chunked=True)
    narrow = sa.select(old.c.job_id, old.c.step, sa.literal(0), *(old.c[m] for m in _METRICS))
    op.execute(
        sa.insert(target).from_select(
            ["job_id", "step", "chunk", *_METRICS], narrow.where(_narrow(old))
        )
    )
    wide = sa.select(*old.c).where(sa.not_(_narrow(old)))
    for page in _pages(wide, old.c.job_id, old.c.step):
        rows = [r for job_id, step, *blobs in page for r in split(job_id, step, blobs)]
        if rows:
            op.get_bind().execute(target.insert(), rows)
    op.drop_table(_OLD)


def downgrade() -> None:
    _set_aside(_NEW)
    _create(chunked=False)
    chunked = _table(_NEW, chunked=True)
    other = chunked.alias("other")
    single = sa.not_(
        sa.exists().where(
            other.c.job_id == chunked.c.job_id,
            other.c.step == chunked.c.step,
            other.c.chunk > 0,
        )
    )
    one_chunk = sa.select(*(chunked.c[c] for c in ("job_id", "step", *_METRICS))).where(
        chunked.c.chunk == 0, single
    )
    op.execute(
        sa.insert(_table("step_matrix", chunked=False)).from_select(
            ["job_id", "step", *_METRICS], one_chunk
        )
    )
    several = sa.select(chunked.c.job_id, chunked.c.step).where(chunked.c.chunk > 0).distinct()
    target = _table("step_matrix", chunked=False)
    for page in _pages(several, chunked.c.job_id, chunked.c.step):
        found: dict[tuple[str, int], list[tuple[int, list[bytes]]]] = {
            (job_id, step): [] for job_id, step in page
        }
        query = sa.select(*chunked.c).where(
            sa.tuple_(chunked.c.job_id, chunked.c.step).in_(list(found))
        )
        for job_id, step, chunk, *blobs in op.get_bind().execute(query):
            found[(job_id, step)].append((chunk, blobs))
        op.get_bind().execute(
            target.insert(), [join(job_id, step, parts) for (job_id, step), parts in found.items()]
        )
    op.drop_table(_NEW)
