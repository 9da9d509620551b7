"""vigil.columns: step records as float64 columns, row for row and field for field."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from vigil import columns, schema


def _step(job: str, rank: int, step: int) -> schema.StepRecord:
    return schema.StepRecord(
        job_id=job,
        rank=rank,
        step=step,
        start_s=10.0 * step,
        end_s=10.0 * step + 1.5 + rank,
        comm_wait_s=0.25,
        tokens=4096,
        mfu=0.4,
        loss=None if rank % 2 else 2.5,
        peak_memory_bytes=3 << 30,
    )


def test_columns_hold_every_numeric_field_of_every_record() -> None:
    records = [_step("a", r, s) for s in range(3) for r in range(4)]
    cols = columns.from_records(records)
    assert len(cols) == 12 and cols.job_ids == ["a"] * 12
    assert "job_id" not in columns.NUMERIC and "loss" not in columns.NUMERIC
    for name in columns.NUMERIC:
        assert cols.column(name).tolist() == [float(getattr(r, name)) for r in records], name
    assert columns.from_rows(list(map(msgspec.structs.astuple, records))).values.tolist() == (
        cols.values.tolist()
    )


def test_of_job_splits_a_mixed_batch_in_record_order() -> None:
    records = [_step("a", 0, 1), _step("b", 1, 1), _step("a", 2, 2)]
    cols = columns.from_records(records)
    a = cols.of_job("a")
    assert a.job_ids == ["a", "a"] and a.column("rank").tolist() == [0.0, 2.0]
    assert cols.of_job("b").column("step").tolist() == [1.0]
    only_a = columns.from_records([records[0]])
    assert only_a.of_job("a") is only_a


def test_empty_batch_and_mismatched_shapes() -> None:
    assert len(columns.from_records([])) == 0
    with pytest.raises(ValueError, match="expected \\(2, "):
        columns.StepColumns(values=np.zeros((3, len(columns.NUMERIC))), job_ids=["a", "b"])
