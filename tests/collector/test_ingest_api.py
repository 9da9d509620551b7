"""POST /api/v1/ingest over ASGI on SQLite and PostgreSQL: acks, duplicates, 4xx messages."""

from __future__ import annotations

from collections.abc import Iterator
from math import inf
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient

from tests.collector import records as rec
from vigil import api, codec, schema
from vigil.collector import CollectorSettings, create_app

pytestmark = pytest.mark.integration
HEADERS = {"content-type": api.BATCH_MEDIA_TYPE}


@pytest.fixture
def client(store_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = CollectorSettings(
        data_dir=tmp_path, store_url=store_url, max_batch_bytes=64 * 1024, max_batch_records=500
    )
    with TestClient(create_app(settings)) as c:
        yield c


def post(client: TestClient, frame: bytes, **headers: str) -> tuple[int, dict[str, object]]:
    r = client.post(api.INGEST_PATH, content=frame, headers={**HEADERS, **headers})
    return r.status_code, r.json()


def test_ack_after_commit_and_duplicates_are_answered_without_storing(client: TestClient) -> None:
    frame = codec.encode_batch(rec.steps(2, 3), batch_id="b-1")
    assert post(client, frame) == (200, {"batch_id": "b-1", "accepted": 6, "duplicate": False})
    # A retry carrying the header is answered before decoding; one without it after decoding.
    assert post(client, frame, **{api.BATCH_ID_HEADER: "b-1"}) == (
        200,
        {"batch_id": "b-1", "accepted": 6, "duplicate": True},
    )
    assert post(client, frame)[1]["duplicate"] is True
    steps = client.get(
        f"/api/v1/jobs/{rec.JOB}/steps", params={"step_start": 0, "step_end": 10}
    ).json()
    assert len(steps) == 6


def test_schema_v1_frames_from_older_senders_are_stored(client: TestClient) -> None:
    """Senders of schema v1 ship step records as records; a v2 collector stores them alike."""
    records = [msgspec.to_builtins(r) for r in rec.steps(2, 2)]
    frame = _raw_frame({"v": 1, "batch_id": "old-1", "records": records})
    assert post(client, frame) == (200, {"batch_id": "old-1", "accepted": 4, "duplicate": False})
    steps = client.get(
        f"/api/v1/jobs/{rec.JOB}/steps", params={"step_start": 0, "step_end": 10}
    ).json()
    assert sorted((s["rank"], s["step"]) for s in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _raw_frame(payload: object) -> bytes:
    return codec.MAGIC + b"\x00" + msgspec.msgpack.encode(payload)


BAD_STEP = {"type": "step", "job_id": "j", "rank": "three", "step": 1, "start_s": 1.0, "end_s": 2.0}


@pytest.mark.parametrize(
    ("frame", "code", "detail"),
    [
        (b"GIF89a", 422, "Batch.<frame>: not a vigil batch"),
        (codec.MAGIC + b"\x01" + b"\x00" * 40, 422, "Batch.<frame>: corrupt zstd payload"),
        (
            _raw_frame({"v": 1, "batch_id": "x", "records": [BAD_STEP]}),
            422,
            "StepRecord.rank: Expected `int`, got `str`",
        ),
        (_raw_frame({"v": 99, "batch_id": "x", "records": []}), 422, "Batch.v: schema version 99"),
        (
            _raw_frame(
                {"v": 1, "batch_id": "x", "records": [{**BAD_STEP, "rank": 1, "end_s": 0.5}]}
            ),
            422,
            "StepRecord",
        ),
        (
            codec.encode_batch([rec.sample("n", 1.0, float("nan"))]),
            422,
            "Sample.value: must be a finite number, got nan",
        ),
        (
            codec.encode_batch([schema.RankInfo(job_id="j", rank=0, node="n\x00x")]),
            422,
            "RankInfo.node: must not contain NUL",
        ),
        (
            codec.encode_batch([rec.step(0, 1), msgspec.structs.replace(rec.step(1, 1), mfu=inf)]),
            422,
            "StepRecord.mfu: record 1: must be a finite number, got inf",
        ),
        (
            codec.encode_batch([msgspec.structs.replace(rec.step(0, 1), job_id="a\x00b")]),
            422,
            "StepRecord.job_id: record 0: must not contain NUL",
        ),
        (
            codec.encode_batch([rec.step(2**40, 1)]),
            422,
            "StepRecord.rank: record 0: rank 1099511627776 is not below world size 131072",
        ),
        (
            _raw_frame({"v": 1, "batch_id": "x", "records": [{**BAD_STEP, "rank": 2**64 - 1}]}),
            422,
            "StepRecord.rank",
        ),
        (
            codec.encode_batch(rec.steps(1, 501)),
            413,
            "Batch.records: 501 records exceeds the 500 limit",
        ),
        (
            b"VGL\x00" + b"\x00" * (65 * 1024),
            413,
            "Batch.<frame>: body exceeds the 65536 byte limit",
        ),
    ],
)
def test_bad_batches_get_a_4xx_naming_record_and_field(
    client: TestClient, frame: bytes, code: int, detail: str
) -> None:
    status, body = post(client, frame)
    assert status == code
    assert str(body["detail"]).startswith(detail), body
    # One bad batch never takes ingest down.
    assert post(client, codec.encode_batch(rec.steps(1, 1)))[0] == 200


def test_media_type_and_batch_id_mismatch_are_refused(client: TestClient) -> None:
    frame = codec.encode_batch(rec.steps(1, 1), batch_id="inside")
    r = client.post(api.INGEST_PATH, content=frame, headers={"content-type": "application/json"})
    assert r.status_code == 415 and api.BATCH_MEDIA_TYPE in r.json()["detail"]
    status, body = post(client, frame, **{api.BATCH_ID_HEADER: "outside"})
    assert status == 422 and "does not match" in str(body["detail"])


def test_metrics_count_rows_duplicates_and_rejections(client: TestClient) -> None:
    frame = codec.encode_batch([*rec.steps(2, 2), rec.sample("n", 1.0, 1.0)], batch_id="m-1")
    post(client, frame)
    post(client, frame, **{api.BATCH_ID_HEADER: "m-1"})
    post(client, b"junk")
    text = client.get("/metrics").text
    assert 'vigil_collector_ingested_rows_total{type="step"} 4.0' in text
    assert 'vigil_collector_ingested_rows_total{type="sample"} 1.0' in text
    assert 'vigil_collector_batches_total{outcome="duplicate"} 1.0' in text
    assert 'vigil_collector_rejected_batches_total{reason="decode"} 1.0' in text
    # The duplicate is found inside its own transaction, so both timed; the junk was not.
    assert "vigil_collector_batch_latency_seconds_count 2.0" in text
    size = next(
        line for line in text.splitlines() if line.startswith("vigil_collector_store_size_bytes ")
    )
    assert float(size.split()[1]) > 0
