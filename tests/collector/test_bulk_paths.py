"""The fast bulk paths agree with the plain ones: the numpy matrix patch with cell-by-cell
patching, validation's field tuples with the writers' own."""

from __future__ import annotations

import math
import random
from array import array

import msgspec
import numpy as np
from sqlalchemy import select

from vigil import columns, schema
from vigil.collector import Store, pgcopy, step_matrix, tables, validate, writes


def _row(rng: random.Random, width: int) -> tuple[object, ...]:
    start = rng.random() * 100
    record = schema.StepRecord(
        job_id=rng.choice(["a", "bb"]),
        rank=rng.randrange(width),
        step=rng.randrange(4),
        start_s=start,
        end_s=start + rng.random(),
        comm_wait_s=rng.random(),
        mfu=rng.random(),
    )
    return msgspec.structs.astuple(record)


def test_matrix_patch_matches_cell_by_cell(store: Store) -> None:
    """Either store's patch (SQLite in numpy, PostgreSQL in the server) against a cell-by-cell
    reference, over widths that cross chunk boundaries."""
    rng = random.Random(7)
    expected: dict[tuple[str, int, int], list[array[float]]] = {}
    for _ in range(40):
        rows = [_row(rng, rng.choice([2, 30, 300, 2100])) for _ in range(rng.choice([1, 7, 200]))]
        with store.write() as conn:
            step_matrix.write(conn, rows)
        # The reference: a later row for a cell wins; a chunk's arrays only widen, to cover the
        # highest cell seen in it, and a chunk no rank reported has no row.
        for job_id, rank, step, start, end, *rest in rows:
            chunk, cell = divmod(rank, step_matrix.CHUNK_RANKS)  # type: ignore[operator]
            arrays = expected.setdefault(
                (job_id, step, chunk), [array("d") for _ in step_matrix.METRICS]
            )  # type: ignore[arg-type]
            for a in arrays:
                a.extend([math.nan] * (cell + 1 - len(a)))
            arrays[0][cell] = end - start  # type: ignore[operator]
            arrays[1][cell] = rest[4]  # type: ignore[assignment]
            arrays[2][cell] = rest[7]  # type: ignore[assignment]
    assert stored_matrix(store) == {
        key: [step_matrix.pack(a) for a in arrays] for key, arrays in expected.items()
    }


def stored_matrix(store: Store) -> dict[tuple[str, int, int], list[bytes]]:
    """Every step_matrix row: (job_id, step, chunk) -> its arrays in METRICS order."""
    t = tables.step_matrix
    with store.read() as conn:
        return {
            (job_id, step, chunk): list(blobs)
            for job_id, step, chunk, *blobs in conn.execute(
                select(t.c.job_id, t.c.step, t.c.chunk, *(t.c[m] for m in step_matrix.METRICS))
            )
        }


def test_runs_end_at_chunk_boundaries() -> None:
    rows = [
        msgspec.structs.astuple(
            schema.StepRecord(job_id="j", rank=r, step=0, start_s=0.0, end_s=float(r))
        )
        for r in [*range(1020, 1030), 2047, 2048, 5]
    ]
    runs = step_matrix.runs(rows)
    assert list(zip(runs.chunks, runs.offsets, runs.levels, strict=True)) == [
        (0, 5, 0),
        (0, 1020, 1),
        (1, 0, 0),
        (1, 1023, 1),
        (2, 0, 0),
    ]
    lengths = [len(b) // 8 for b in runs.blobs[0]]
    assert lengths == [1, 4, 6, 1, 1]
    assert np.frombuffer(runs.blobs[0][2], dtype="<f8").tolist() == [1024.0 + i for i in range(6)]


def test_checked_batch_reuses_the_writers_tuples() -> None:
    step = schema.StepRecord(job_id="j", rank=0, step=0, start_s=1.0, end_s=2.0)
    beat = schema.Heartbeat(job_id="j", rank=0, time_s=1.0)
    records: list[schema.Record] = [step, beat, step]
    checked = validate.check_batch(records)
    assert checked.groups == {schema.StepRecord: [step, step], schema.Heartbeat: [beat]}
    assert checked.rows[schema.StepRecord] == [writes.as_row(step)] * 2
    assert validate.group_records(records) == checked.groups
    assert validate.group_records([step]) == {schema.StepRecord: [step]}


def test_step_columns_copy_in_binary_exactly_as_their_tuples(store: Store) -> None:
    """PostgreSQL gets block rows as one binary COPY stream laid out from columns; SQLite gets
    their tuples. Either way the stored rows equal the records: several jobs, unknown and
    infinite losses; a batch re-running stored steps replaces them (PostgreSQL's staging path,
    which builds the tuples after all)."""
    records = [
        schema.StepRecord(
            job_id=job,
            rank=rank,
            step=step,
            start_s=1.5 * step,
            end_s=1.5 * step + 0.25 + rank,
            tokens=2**40 + rank,
            mfu=0.5,
            loss=None if rank == 1 else (math.inf if rank == 2 else 0.125 * rank),
            peak_memory_bytes=3 << 30,
        )
        for step in range(3)
        for job in ("job-a", "job-é")
        for rank in range(4)
    ]
    assert _ingest_as_block(store, "copy-1", records) == sorted(map(writes.as_row, records))
    rerun = [msgspec.structs.replace(r, mfu=0.25) for r in records[:5]]
    expected = sorted(map(writes.as_row, rerun + records[5:]))
    assert _ingest_as_block(store, "copy-2", rerun) == expected


def _ingest_as_block(
    store: Store, batch_id: str, records: list[schema.StepRecord]
) -> list[tuple[object, ...]]:
    """Ingest `records` as one columnar block; every stored step row, sorted."""
    block = columns.to_block(records)
    assert block is not None
    batch = schema.Batch(v=schema.SCHEMA_VERSION, batch_id=batch_id, records=[])
    store.ingest(batch, validate.prepare_batch([], columns.from_block(block)))
    with store.read() as conn:
        stored = conn.execute(select(*tables.step_records.c[*writes.STEP_COLUMNS])).all()
    return sorted(map(tuple, stored))


def test_the_binary_copy_stream_matches_psycopgs_own_rows() -> None:
    cols = columns.from_records(
        [schema.StepRecord(job_id="j", rank=3, step=7, start_s=1.0, end_s=2.0, loss=0.5)]
    )
    cols = columns.StepColumns(values=cols.values, job_ids=cols.job_ids, loss=np.array([0.5]))
    stream = writes.step_copy(cols)
    assert stream.startswith(pgcopy.SIGNATURE) and stream.endswith(pgcopy.TRAILER)
    body = stream[len(pgcopy.SIGNATURE) : -len(pgcopy.TRAILER)]
    # 22 fields: count, then job_id (1 byte), 20 numbers of 8 bytes and the loss.
    assert len(body) == 2 + (4 + 1) + 21 * (4 + 8)
    assert body[:2] == (22).to_bytes(2, "big") and body[2:7] == b"\x00\x00\x00\x01j"
    assert body[7:19] == (8).to_bytes(4, "big") + (3).to_bytes(8, "big")  # rank
