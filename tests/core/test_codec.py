"""Bad input to the codec: one typed error naming the record type, the field and the problem."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from vigil import codec, schema


def _step(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "type": "step",
        "job_id": "j",
        "rank": 0,
        "step": 1,
        "start_s": 1.0,
        "end_s": 2.0,
    }
    base.update(overrides)
    return base


def _frame(records: list[object], v: object = schema.SCHEMA_VERSION) -> bytes:
    raw = {"v": v, "batch_id": "b", "records": records}
    return codec.MAGIC + b"\x00" + msgspec.msgpack.encode(raw)


def test_wrong_field_type_names_record_and_field() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([_step(), _step(rank="three")]))
    assert info.value.record_type == "StepRecord"
    assert info.value.field == "rank"
    assert "int" in info.value.problem
    assert str(info.value).startswith("StepRecord.rank: ")


def test_constraint_violation_names_field() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([{"type": "heartbeat", "job_id": "j", "rank": -1, "time_s": 0}]))
    assert (info.value.record_type, info.value.field) == ("Heartbeat", "rank")
    assert ">= 0" in info.value.problem


def test_cross_field_rule_is_reported() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([_step(start_s=5.0, end_s=1.0)]))
    assert info.value.record_type == "StepRecord"
    assert "end_s" in info.value.problem


def test_missing_field_and_unknown_type() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([{"type": "sample", "node": "n", "metric": "m", "value": 1}]))
    assert info.value.record_type == "Sample"
    assert "time_s" in info.value.problem
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([{"type": "telemetry", "x": 1}]))
    assert "telemetry" in str(info.value)


def test_wrong_version_is_refused_even_when_shapes_differ() -> None:
    with pytest.raises(codec.DecodeError, match="schema version 99") as info:
        codec.decode_batch(_frame([_step()], v=99))
    assert info.value.field == "v"
    with pytest.raises(codec.DecodeError, match="schema version 3"):
        codec.decode_batch(_frame([{"type": "step", "totally": "different"}], v=3))


def test_truncated_and_garbage_frames() -> None:
    good = codec.encode_batch([schema.Heartbeat(job_id="j", rank=1, time_s=3.0)])
    for bad in (good[:2], good[: len(good) // 2], b"", b"GET / HTTP/1.1", b"VGL\x00\xc1"):
        with pytest.raises(codec.DecodeError):
            codec.decode_batch(bad)
    raw = codec.encode_batch([schema.Heartbeat(job_id="j", rank=1, time_s=3.0)], compress=False)
    with pytest.raises(codec.DecodeError, match=r"Batch\.<payload>"):
        codec.decode_batch(raw[:-3])
    with pytest.raises(codec.DecodeError, match="unknown frame flags"):
        codec.decode_batch(codec.MAGIC + b"\x80" + raw[4:])


def test_size_limits_are_enforced() -> None:
    records = [schema.Heartbeat(job_id="j", rank=r, time_s=1.0) for r in range(100)]
    frame = codec.encode_batch(records)
    with pytest.raises(codec.DecodeError, match="exceeds the 10 byte limit"):
        codec.decode_batch(frame, max_bytes=10)
    with pytest.raises(codec.DecodeError, match="100 records exceeds the 50"):
        codec.decode_batch(frame, max_records=50)
    with pytest.raises(codec.DecodeError, match="decompresses beyond"):
        codec.decode_batch(frame, max_decompressed_bytes=64)


def test_zstd_bomb_without_content_size_is_bounded() -> None:
    """A streamed zstd frame does not declare its size; decoding must still stop at the limit."""
    stream = zstandard.ZstdCompressor().compressobj()
    bomb = stream.compress(b"\x00" * 5_000_000) + stream.flush()
    with pytest.raises(codec.DecodeError, match="decompresses beyond"):
        codec.decode_batch(
            codec.MAGIC + bytes([codec.FLAG_ZSTD]) + bomb, max_decompressed_bytes=1_000_000
        )


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(codec.DecodeError, match="expected bytes"):
        codec.decode_batch("VGL" + "x")  # type: ignore[arg-type]


def test_json_line_errors_name_record_and_field() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_json(
            b'{"type":"coll_agg","job_id":"j","rank":0,"step":1,"group":"g",'
            b'"op":"all_reduce","count":"many"}'
        )
    assert (info.value.record_type, info.value.field) == ("CollectiveAggregate", "count")
    with pytest.raises(codec.DecodeError, match=r"Record\.<line>"):
        codec.decode_json(b'{"type": "step", "job_')


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512))
def test_random_bytes_only_raise_decode_error(data: bytes) -> None:
    for frame in (data, codec.MAGIC + b"\x00" + data, codec.MAGIC + b"\x01" + data):
        with contextlib.suppress(codec.DecodeError):
            codec.decode_batch(frame)


_VALID = codec.encode_batch(
    [
        schema.StepRecord(job_id="job", rank=3, step=7, start_s=1.0, end_s=1.5, tokens=4096),
        schema.CollectiveAggregate(
            job_id="job",
            rank=3,
            step=7,
            group="dp",
            op="all_reduce",
            count=4,
            bytes=1 << 20,
            total_device_s=0.01,
        ),
    ],
    compress=False,
)


@settings(max_examples=500, deadline=None)
@given(
    edits=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=len(_VALID) - 1),
            st.integers(min_value=0, max_value=255),
        ),
        min_size=1,
        max_size=6,
    ),
    cut=st.integers(min_value=1, max_value=len(_VALID)),
    compress=st.booleans(),
)
def test_mutated_frames_only_raise_decode_error(
    edits: list[tuple[int, int]], cut: int, compress: bool
) -> None:
    mutated = bytearray(_VALID)
    for pos, value in edits:
        mutated[pos] = value
    frame = bytes(mutated[:cut])
    if compress and len(frame) > 4:
        frame = codec.MAGIC + b"\x01" + zstandard.ZstdCompressor().compress(frame[4:])
    try:
        batch = codec.decode_batch(frame)
    except codec.DecodeError as exc:
        assert exc.record_type and exc.field and exc.problem
    else:
        assert all(isinstance(r, schema.RECORD_TYPES) for r in batch.records)


def _steps(n: int) -> list[schema.StepRecord]:
    return [
        schema.StepRecord(job_id="j", rank=r, step=1, start_s=1.0, end_s=2.0 + r, loss=0.5)
        for r in range(n)
    ]


def test_step_records_travel_as_one_columnar_block() -> None:
    beat = schema.Heartbeat(job_id="j", rank=0, time_s=1.0)
    frame = codec.encode_batch([*_steps(3), beat], compress=False)
    raw = msgspec.msgpack.decode(frame[4:])
    assert raw["v"] == 2 and len(raw["records"]) == 1 and raw["steps"]["job_ids"] == ["j"]
    batch, steps = codec.decode_frame(frame)
    assert batch.records == [beat] and steps is not None and len(steps) == 3
    assert steps.column("end_s").tolist() == [2.0, 3.0, 4.0]
    assert codec.decode_batch(frame).records == [beat, *_steps(3)]


def test_schema_v1_frames_with_step_records_still_decode() -> None:
    frame = _frame([_step(), _step(rank=1)], v=1)
    batch, steps = codec.decode_frame(frame)
    assert steps is None and [r.rank for r in batch.records] == [0, 1]  # type: ignore[union-attr]


def test_a_bad_step_block_names_record_type_and_field() -> None:
    raw = msgspec.msgpack.decode(codec.encode_batch(_steps(2), compress=False)[4:])
    raw["steps"]["jobs"] = raw["steps"]["jobs"][:4]
    frame = codec.MAGIC + b"\x00" + msgspec.msgpack.encode(raw)
    with pytest.raises(codec.DecodeError, match=r"StepRecord\.job_id: jobs: 4 bytes for 2") as info:
        codec.decode_batch(frame)
    assert info.value.record_type == "StepRecord" and info.value.field == "job_id"


def test_the_record_limit_counts_block_rows() -> None:
    frame = codec.encode_batch(_steps(100))
    with pytest.raises(codec.DecodeError, match="100 records exceeds the 50"):
        codec.decode_frame(frame, max_records=50)
    assert len(codec.decode_frame(frame, max_records=100)[1] or ()) == 100


def test_record_count_is_refused_before_records_are_built() -> None:
    """A small compressed frame that inflates to millions of records is refused from the
    array header, before one record object exists (time and memory stay small)."""
    import time
    import tracemalloc

    beat = msgspec.msgpack.encode({"type": "heartbeat", "job_id": "j", "rank": 0, "time_s": 1.0})
    count = 2_000_000
    # {"v": 2, "batch_id": "b", "records": [beat] * count}, built without a Python list.
    head = b"\x83" + msgspec.msgpack.encode("v") + msgspec.msgpack.encode(schema.SCHEMA_VERSION)
    head += msgspec.msgpack.encode("batch_id") + msgspec.msgpack.encode("b")
    head += msgspec.msgpack.encode("records") + b"\xdd" + count.to_bytes(4, "big")
    frame = codec.MAGIC + bytes([codec.FLAG_ZSTD])
    frame += zstandard.ZstdCompressor().compress(head + beat * count)
    assert len(frame) < 100_000
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(codec.DecodeError, match="2000000 records exceeds the 100000 limit"):
        codec.decode_frame(frame, max_decompressed_bytes=256 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.perf_counter() - started < 2.0
    assert peak < 3 * len(head + beat * count)  # the inflated bytes, not millions of objects


def test_nested_lists_and_strings_are_bounded() -> None:
    many = {"type": "finding", "finding_id": "f", "kind": "hang", "job_id": "j"}
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([{**many, "evidence": [{"metric": "m", "observed": 1.0}] * 65}]))
    assert (info.value.record_type, info.value.field) == ("Finding", "evidence")
    assert "length <= 64" in info.value.problem
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([{**many, "subjects": {"ranks": list(range(5000))}}]))
    assert (info.value.record_type, info.value.field) == ("Finding", "subjects.ranks")
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([{**many, "summary": "x" * 5000}]))
    assert info.value.field == "summary" and "length <= 4096" in info.value.problem
    beat = {"type": "heartbeat", "job_id": "j", "rank": 0, "time_s": 1.0}
    with pytest.raises(codec.DecodeError) as info:
        codec.decode_batch(_frame([beat, {**beat, "last_group": "g" * 300}]))
    assert (info.value.record_type, info.value.field) == ("Heartbeat", "last_group")
    # Within the bounds everything decodes.
    ok = {**many, "subjects": {"ranks": list(range(4096))}, "summary": "x" * 4096}
    assert len(codec.decode_batch(_frame([ok])).records) == 1
