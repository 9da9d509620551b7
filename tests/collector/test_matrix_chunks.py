"""The heatmap matrix in chunks of 1,024 ranks, on SQLite and on a real PostgreSQL server:
storage and reads follow the ranks that report, dense jobs keep every cell across chunk
boundaries, and migration 0004 converts stored matrices both ways."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from tests.collector import records as rec
from tests.collector.test_bulk_paths import stored_matrix
from vigil import schema
from vigil.collector import Store, StoreConfig, heatmap, migrate, step_matrix, tables

pytestmark = pytest.mark.integration

TOP_RANK = 131_071
Cells = dict[tuple[str, int, int], tuple[float, float, float]]  # (job, step, rank) -> metrics


def _read(
    store: Store, step_end: int, *, job: str = rec.JOB, max_steps: int = 1000, step_start: int = 0
) -> dict[str, Any]:
    with store.read() as conn:
        return heatmap.heatmap(
            conn,
            job,
            metric=heatmap.HeatmapMetric.STEP_TIME,
            step_start=step_start,
            step_end=step_end,
            max_steps=max_steps,
        )


def _bytes_per_step(store: Store) -> dict[int, tuple[int, int]]:
    """Per step: (rows, stored array bytes of all metrics)."""
    t = tables.step_matrix
    size = sum((sa.func.length(t.c[m]) for m in step_matrix.METRICS), sa.literal(0))
    query = sa.select(t.c.step, sa.func.count(), sa.func.sum(size)).group_by(t.c.step)
    with store.read() as conn:
        return {step: (int(n), int(b)) for step, n, b in conn.execute(query)}


def test_a_lone_high_rank_stores_one_chunk_per_step(store: Store) -> None:
    store.ingest(rec.batch([rec.step(TOP_RANK, s) for s in range(40)], "top"))
    per_step = _bytes_per_step(store)
    assert sorted(per_step) == list(range(40))
    assert all(rows == 1 and size <= 3 * 8 * 1024 for rows, size in per_step.values())
    h = _read(store, 39)
    assert h["ranks"] == [TOP_RANK] and h["steps"] == list(range(40))
    assert h["values"] == [[0.5]] * 40


def test_sparse_ranks_downsample_to_their_means(store: Store) -> None:
    """Ranks in three chunks over 10 steps at stride 5: each column is the mean of the steps
    a rank reported, a rank silent for a whole column is NaN there."""
    records = [rec.step(3, s, seconds=float(s)) for s in range(10)]
    records += [rec.step(1500, s, seconds=1.0) for s in (0, 4)]
    records += [rec.step(TOP_RANK, s, seconds=2.0 + s) for s in (7, 8)]
    store.ingest(rec.batch(records, "sparse"))
    h = _read(store, 9, max_steps=2)
    assert h["stride"] == 5 and h["steps"] == [0, 5] and h["ranks"] == [3, 1500, TOP_RANK]
    assert h["values"][0][:2] == [2.0, 1.0] and math.isnan(h["values"][0][2])
    assert h["values"][1][0] == 7.0 and math.isnan(h["values"][1][1])
    assert h["values"][1][2] == 9.5


def _metrics(record: schema.StepRecord) -> tuple[float, float, float]:
    return (record.end_s - record.start_s, record.comm_wait_s, record.mfu)


def _ingest(store: Store, batches: Iterable[list[schema.StepRecord]], expected: Cells) -> None:
    for i, records in enumerate(batches):
        store.ingest(rec.batch(records, f"dense-{i}"))
        for r in records:  # a later record for a cell wins, within a batch and across them
            expected[(r.job_id, r.step, r.rank)] = _metrics(r)


def _chunked(expected: Cells) -> dict[tuple[str, int, int], list[bytes]]:
    """The rows the write paths must store for `expected`: per (job, step, chunk), arrays up to
    the chunk's highest reported cell (NaN = missing)."""
    rows: dict[tuple[str, int, int], np.ndarray] = {}  # type: ignore[type-arg]
    for (job, step, rank), values in sorted(expected.items()):
        chunk, cell = divmod(rank, step_matrix.CHUNK_RANKS)
        grid = rows.get((job, step, chunk), np.full((3, 0), np.nan))
        if grid.shape[1] <= cell:
            grid = np.pad(grid, ((0, 0), (0, cell + 1 - grid.shape[1])), constant_values=np.nan)
        grid[:, cell] = values
        rows[(job, step, chunk)] = grid
    return {key: [a.astype("<f8").tobytes() for a in grid] for key, grid in rows.items()}


def test_dense_jobs_across_chunks_keep_every_cell(store: Store) -> None:
    """Ranks 0..2100 (three chunks) written by batches split mid-chunk, then re-runs across the
    boundaries and a cell repeated within a batch: the cells are those of the records."""

    def step(rank: int, s: int, seconds: float) -> schema.StepRecord:
        return rec.step(rank, s, seconds=seconds, wait=rank / 1e4, mfu=0.3 + s / 100)

    first = [step(r, s, 0.5 + r / 1e4) for s in range(6) for r in range(1500)]
    second = [step(r, s, 0.5 + r / 1e4) for s in range(6) for r in range(1500, 2101)]
    reruns = [step(r, s, 2.0) for s in (2, 3) for r in [*range(1000, 1100), *range(2040, 2060)]]
    reruns += [step(1023, 3, 3.0), step(1024, 3, 4.0)]  # the same cells again: these win
    late = [step(2100, 6, 1.0), rec.step(5, 2, job="other")]
    expected: Cells = {}
    _ingest(store, [first, second, reruns, late], expected)
    assert stored_matrix(store) == _chunked(expected)
    # Steps 0..5 have the same chunks, each as wide, with no cell missing (the dense read);
    # step 6 has rank 2100 alone.
    for step_end in (5, 6):
        h = _read(store, step_end)
        assert h["ranks"] == list(range(2101)) and h["steps"] == list(range(step_end + 1))
        for i, s in enumerate(h["steps"]):
            for j, rank in enumerate(h["ranks"]):
                want = expected.get((rec.JOB, s, rank), (math.nan,))[0]
                got = h["values"][i][j]
                assert got == want or (math.isnan(got) and math.isnan(want)), (s, rank)
    assert _read(store, 6, job="other")["ranks"] == [5]


# --- migration 0004 ----------------------------------------------------------------------------

# Matrices as revision 0003 stored them: one array per (job, step) from rank 0 to the highest.
_OLD_CELLS: dict[tuple[str, int], dict[int, float]] = {
    ("a", 0): {0: 1.0, 1: 2.0, 3: 4.0},
    ("a", 1): {0: 1.5, TOP_RANK: 9.0},
    ("b", 0): {r: float(r) for r in range(1020, 1031)},
    ("b", 1): {2048: 7.0},
    ("c", 5): {1023: 3.0},
}


def _old_rows() -> list[dict[str, object]]:
    rows = []
    for (job, step), cells in _OLD_CELLS.items():
        arrays = np.full((3, max(cells) + 1), np.nan, dtype="<f8")
        for rank, value in cells.items():
            arrays[:, rank] = (value, value / 10, value / 100)
        blobs = {m: arrays[i].tobytes() for i, m in enumerate(step_matrix.METRICS)}
        rows.append({"job_id": job, "step": step, **blobs})
    return rows


def _old_table() -> sa.TableClause:
    return sa.table(
        "step_matrix", *(sa.column(c) for c in ("job_id", "step", *step_matrix.METRICS))
    )


def _move(store: Store, revision: str) -> None:
    config = migrate.alembic_config()
    with store.engine.begin() as conn:
        config.attributes["connection"] = conn
        before = migrate.current_revision(conn)
        if before is None or before < revision:
            command.upgrade(config, revision)
        else:
            command.downgrade(config, revision)


def _storage(store: Store) -> set[str]:
    """PostgreSQL's storage of the array columns ('e': external, as revision 0002 sets)."""
    query = sa.text(
        "SELECT attstorage FROM pg_attribute WHERE attrelid = 'step_matrix'::regclass "
        "AND attname IN ('step_time', 'comm_wait', 'mfu')"
    )
    with store.read() as conn:
        return {str(s) for (s,) in conn.execute(query)}


def test_migration_0004_splits_matrices_into_chunks_and_back(store_url: str) -> None:
    store = Store(StoreConfig(url=store_url))
    try:
        _move(store, "0003")
        with store.write() as conn:
            conn.execute(_old_table().insert(), _old_rows())
        assert store.migrate() == migrate.head_revision() >= "0004"
        with store.read() as conn:
            assert compare_metadata(MigrationContext.configure(conn), tables.metadata) == []
        stored = stored_matrix(store)
        # Chunks without a value are gone: ("a", 1) keeps chunks 0 and 127, ("b", 1) chunk 2.
        assert sorted(stored) == [
            ("a", 0, 0),
            ("a", 1, 0),
            ("a", 1, 127),
            ("b", 0, 0),
            ("b", 0, 1),
            ("b", 1, 2),
            ("c", 5, 0),
        ]
        assert all(len(b) <= 8 * 1024 for blobs in stored.values() for b in blobs)
        for job, step in _OLD_CELLS:
            h = _read(store, step, job=job, step_start=step)
            cells = _OLD_CELLS[(job, step)]
            assert h["ranks"] == sorted(cells) and h["steps"] == [step]
            assert h["values"] == [[cells[r] for r in sorted(cells)]]
        if store.dialect == "postgresql":
            assert _storage(store) == {"e"}
        _move(store, "0003")
        with store.read() as conn:
            old = {(r.job_id, r.step): tuple(r[2:]) for r in conn.execute(sa.select(_old_table()))}
        assert old == {
            (r["job_id"], r["step"]): tuple(r[m] for m in step_matrix.METRICS) for r in _old_rows()
        }
        if store.dialect == "postgresql":
            assert _storage(store) == {"e"}
        # Upgraded again, the migrated rows are what the write paths write: a patch extends them.
        store.migrate()
        store.ingest(rec.batch([rec.step(2049, 1, job="b", seconds=1.0)], "after"))
        h = _read(store, 1, job="b")
        assert h["ranks"] == [*range(1020, 1031), 2048, 2049]
        assert h["values"][1][-2:] == [7.0, 1.0]
    finally:
        store.close()
