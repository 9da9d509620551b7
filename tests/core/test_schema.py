"""Every wire record round-trips through the batch codec and the JSONL format."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import strategies
from vigil import codec, schema


@pytest.mark.parametrize("record_type", schema.RECORD_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_record_type_round_trips(record_type: type, data: st.DataObject) -> None:
    record = data.draw(strategies.for_struct(record_type))
    for compress in (True, False):
        frame = codec.encode_batch([record], batch_id="b-1", compress=compress)
        batch = codec.decode_batch(frame)
        assert batch.batch_id == "b-1"
        assert batch.records == [record]
        assert type(batch.records[0]) is record_type
    assert codec.decode_json(codec.encode_json(record)) == record


@settings(max_examples=50, deadline=None)
@given(records=st.lists(strategies.any_record, max_size=20))
def test_mixed_batches_keep_order_and_types(records: list[schema.Record]) -> None:
    batch = codec.decode_batch(codec.encode_batch(records, source="node-1"))
    # Step records travel as the columnar block and come back after the other records, in
    # their order; an integer too large for the block keeps them in place.
    steps = [r for r in records if type(r) is schema.StepRecord]
    others = [r for r in records if type(r) is not schema.StepRecord]
    assert batch.records in (others + steps, records)
    assert list(map(type, batch.records)) in (
        list(map(type, others + steps)),
        list(map(type, records)),
    )
    assert batch.source == "node-1"
    assert batch.v == schema.SCHEMA_VERSION


def test_tags_are_unique_and_name_every_record_type() -> None:
    assert len(schema.RECORD_TAGS) == len(schema.RECORD_TYPES)
    assert set(schema.RECORD_TAGS.values()) == set(schema.RECORD_TYPES)


def test_step_record_rejects_end_before_start() -> None:
    with pytest.raises(ValueError, match="end_s"):
        schema.StepRecord(job_id="j", rank=0, step=1, start_s=10.0, end_s=9.0)


def test_layout_world_size_ignores_expert_parallel() -> None:
    assert schema.ParallelLayout(dp=4, tp=2, pp=2, ep=4).world_size == 16


def test_unknown_fields_from_newer_senders_are_ignored() -> None:
    """Adding an optional field keeps the schema version: old decoders must skip it."""
    raw = {
        "v": schema.SCHEMA_VERSION,
        "batch_id": "x",
        "records": [
            {"type": "heartbeat", "job_id": "j", "rank": 3, "time_s": 1.0, "new_field": [1, 2]}
        ],
    }
    frame = codec.MAGIC + b"\x00" + msgspec.msgpack.encode(raw)
    (record,) = codec.decode_batch(frame).records
    assert record == schema.Heartbeat(job_id="j", rank=3, time_s=1.0)
