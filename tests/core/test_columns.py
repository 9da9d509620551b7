"""vigil.columns: step records as float64 columns, row for row and field for field."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _block(**change: object) -> schema.StepBlock:
    block = columns.to_block([_step("a", r, 2) for r in range(3)])
    assert block is not None
    return msgspec.structs.replace(block, **change)


def test_a_block_round_trips_records_and_tuples_exactly() -> None:
    records = [_step(job, r, s) for s in range(3) for job in ("a", "b") for r in range(4)]
    records[1] = msgspec.structs.replace(records[1], loss=float("inf"))
    block = columns.to_block(records)
    assert block is not None and block.job_ids == ["a", "b"]
    cols = columns.from_block(block)
    assert cols.job_ids == [r.job_id for r in records]
    assert columns.to_records(cols) == records
    rows = columns.rows(cols)
    assert rows == [msgspec.structs.astuple(r) for r in records]
    assert all(type(row[1]) is int and type(row[3]) is float for row in rows)
    assert (
        columns.from_block(columns.to_block([]) or _block(values=b"", jobs=b"", loss=b"")).job_ids
        == []
    )


def test_a_nan_loss_travels_as_unknown() -> None:
    record = msgspec.structs.replace(_step("a", 0, 0), loss=float("nan"))
    block = columns.to_block([record])
    assert block is not None
    assert columns.to_records(columns.from_block(block))[0].loss is None


def test_integers_a_block_cannot_hold_exactly_keep_the_records() -> None:
    big = msgspec.structs.replace(_step("a", 0, 0), peak_memory_bytes=2**53 + 1)
    assert columns.to_block([big]) is None


def test_a_block_with_a_subset_of_fields_fills_defaults() -> None:
    fields = ["rank", "step", "start_s", "end_s"]
    values = np.array([[3, 7, 1.0, 2.5]], dtype="<f8").tobytes()
    block = schema.StepBlock(
        fields=fields, job_ids=["j"], jobs=np.zeros(1, "<u4").tobytes(), values=values
    )
    (record,) = columns.to_records(columns.from_block(block))
    assert record == schema.StepRecord(job_id="j", rank=3, step=7, start_s=1.0, end_s=2.5)


def _with_value(field: str, value: float) -> schema.StepBlock:
    block = _block()
    values = np.frombuffer(block.values, "<f8").reshape(3, len(columns.NUMERIC)).copy()
    values[2, columns.index(field)] = value
    return _block(values=values.tobytes())


@pytest.mark.parametrize(
    ("block", "field", "problem"),
    [
        (_with_value("comm_wait_s", -1.0), "comm_wait_s", "record 2: must be a number >= 0"),
        (_with_value("mfu", float("nan")), "mfu", "record 2: must be a number >= 0, got nan"),
        (_with_value("tokens", 1.5), "tokens", "record 2: must be a whole number"),
        (_with_value("rank", 2.0**60), "rank", "below 2\\*\\*53"),
        (_with_value("end_s", 0.0), "end_s", "record 2: end_s \\(0.0\\) is before start_s"),
        (_block(fields=["rank", "step", "start_s", "nope"]), "nope", "not a numeric"),
        (_block(values=_block().values[:-8]), "<block>", "not whole records"),
        (_block(values=b""), "job_id", "jobs: 12 bytes for 0 records"),
        (_block(jobs=np.array([0, 0, 5], "<u4").tobytes()), "job_id", "record 2: job index 5"),
        (_block(loss=b"\x00" * 8), "loss", "8 bytes for 3 records"),
    ],
)
def test_a_bad_block_names_field_and_record(
    block: schema.StepBlock, field: str, problem: str
) -> None:
    with pytest.raises(columns.BlockError, match=problem) as info:
        columns.from_block(block)
    assert info.value.field == field


def test_a_block_missing_a_required_field_is_refused() -> None:
    fields = ["rank", "step", "start_s"]
    values = np.zeros((1, 3), "<f8").tobytes()
    block = schema.StepBlock(
        fields=fields, job_ids=["j"], jobs=np.zeros(1, "<u4").tobytes(), values=values
    )
    with pytest.raises(columns.BlockError, match="required") as info:
        columns.from_block(block)
    assert info.value.field == "end_s"


@settings(max_examples=200, deadline=None)
@given(
    fields=st.lists(st.sampled_from([*columns.NUMERIC, "job_id", "x"]), max_size=16),
    job_ids=st.lists(st.text(min_size=1, max_size=3), max_size=3),
    jobs=st.binary(max_size=64),
    values=st.binary(max_size=512),
    loss=st.binary(max_size=64),
)
def test_any_block_either_unpacks_or_raises_a_block_error(
    fields: list[str], job_ids: list[str], jobs: bytes, values: bytes, loss: bytes
) -> None:
    block = schema.StepBlock(fields=fields, job_ids=job_ids, jobs=jobs, values=values, loss=loss)
    try:
        cols = columns.from_block(block)
    except columns.BlockError as exc:
        assert exc.field and exc.problem
        return
    records = columns.to_records(cols)  # whatever unpacks is valid StepRecords
    assert len(records) == len(cols) == len(jobs) // 4
