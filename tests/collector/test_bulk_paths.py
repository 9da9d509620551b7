"""The fast bulk paths agree with the plain ones: the numpy matrix patch with cell-by-cell
patching, validation's field tuples with the writers' own."""

from __future__ import annotations

import math
import random
from array import array

import msgspec
from sqlalchemy import select

from vigil import schema
from vigil.collector import Store, matrix, tables, validate, writes


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
    rng = random.Random(7)
    expected: dict[tuple[str, int], list[array[float]]] = {}
    for _ in range(40):
        rows = [_row(rng, rng.choice([2, 30, 300])) for _ in range(rng.choice([1, 7, 200]))]
        with store.write() as conn:
            matrix.write(conn, rows)
        for row in rows:  # the reference: a later row for a cell wins; a step's arrays only
            # widen, to cover the highest rank seen for that step
            cells = expected.setdefault((row[0], row[2]), [array("d") for _ in matrix.METRICS])  # type: ignore[index]
            for a in cells:
                a.extend([math.nan] * (row[1] + 1 - len(a)))  # type: ignore[operator]
        for job_id, rank, step, start, end, *rest in rows:
            cells = expected[(job_id, step)]  # type: ignore[index]
            cells[0][rank] = end - start  # type: ignore[index,operator]
            cells[1][rank] = rest[4]  # type: ignore[index,assignment]
            cells[2][rank] = rest[7]  # type: ignore[index,assignment]
    t = tables.step_matrix
    with store.read() as conn:
        stored = {
            (job_id, step): list(blobs)
            for job_id, step, *blobs in conn.execute(
                select(t.c.job_id, t.c.step, t.c.step_time, t.c.comm_wait, t.c.mfu)
            )
        }
    assert stored == {key: [matrix.pack(a) for a in cells] for key, cells in expected.items()}


def test_checked_batch_reuses_the_writers_tuples() -> None:
    step = schema.StepRecord(job_id="j", rank=0, step=0, start_s=1.0, end_s=2.0)
    beat = schema.Heartbeat(job_id="j", rank=0, time_s=1.0)
    records: list[schema.Record] = [step, beat, step]
    checked = validate.check_batch(records)
    assert checked.groups == {schema.StepRecord: [step, step], schema.Heartbeat: [beat]}
    assert checked.rows[schema.StepRecord] == [writes.as_row(step)] * 2
    assert validate.group_records(records) == checked.groups
    assert validate.group_records([step]) == {schema.StepRecord: [step]}
