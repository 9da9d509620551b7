"""POST /api/v1/ingest/frames (a node agent's relay) on SQLite and PostgreSQL: each frame is
answered as a lone POST of it would have been, good frames are stored once, bad ones alone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient

from tests.collector import records as rec
from tests.collector.conftest import MakeClient
from vigil import api, codec, schema
from vigil.collector import CollectorSettings, create_app

pytestmark = pytest.mark.integration
FRAMES = {"content-type": api.FRAMES_MEDIA_TYPE}
LONE = {"content-type": api.BATCH_MEDIA_TYPE}


def _client(store_url: str, tmp_path: Path) -> TestClient:
    settings = CollectorSettings(
        data_dir=tmp_path, store_url=store_url, max_batch_bytes=64 * 1024, max_batch_records=500
    )
    return TestClient(create_app(settings))


@pytest.fixture
def client(store_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with _client(store_url, tmp_path) as c:
        yield c


def _raw_frame(payload: object) -> bytes:
    return codec.MAGIC + b"\x00" + msgspec.msgpack.encode(payload)


def _mixed_frames() -> list[bytes]:
    """Good frames, a retry of one inside the same envelope, and bad ones of several kinds."""
    first = codec.encode_batch(rec.steps(2, 2), batch_id="f-1")
    return [
        first,
        codec.encode_batch(rec.steps(2, 2, first=2), batch_id="f-2"),
        b"GIF89a",
        first,  # the same batch again: a duplicate, nothing stored twice
        _raw_frame({"v": 1, "batch_id": "x", "records": [{"type": "step", "rank": "three"}]}),
        codec.encode_batch([rec.sample("n", 1.0, float("nan"))], batch_id="f-nan"),
        codec.encode_batch(rec.steps(1, 501), batch_id="f-big"),
        codec.encode_batch([rec.step(2**40, 1)], batch_id="f-rank"),
        codec.encode_batch([*rec.steps(2, 1, first=4), rec.sample("n", 2.0, 3.0)], batch_id="f-3"),
    ]


def _steps(client: TestClient) -> list[tuple[int, int]]:
    got = client.get(f"/api/v1/jobs/{rec.JOB}/steps", params={"step_start": 0, "step_end": 99})
    return sorted((s["rank"], s["step"]) for s in got.json())


def test_each_frame_is_answered_as_its_lone_post_would_be(
    store_url: str, tmp_path: Path, make_client: MakeClient
) -> None:
    frames = _mixed_frames()
    lone = make_client(max_batch_bytes=64 * 1024, max_batch_records=500)
    expected = []
    for frame in frames:
        r = lone.post(api.INGEST_PATH, content=frame, headers=LONE)
        expected.append({"status": r.status_code, **r.json()})
    with _client(store_url, tmp_path) as client:
        r = client.post(api.INGEST_FRAMES_PATH, content=codec.encode_frames(frames), headers=FRAMES)
        assert r.status_code == 200, r.text
        assert r.json()["results"] == expected
        assert [x["status"] for x in expected] == [200, 200, 422, 200, 422, 422, 413, 422, 200]
        assert expected[3]["duplicate"] is True and expected[0]["duplicate"] is False
        # Every good frame's records once, none of a bad frame's.
        assert _steps(client) == _steps(lone) == [(r, s) for r in range(2) for s in range(5)]
        # A second envelope of the same frames stores nothing new.
        again = client.post(
            api.INGEST_FRAMES_PATH, content=codec.encode_frames(frames[:2]), headers=FRAMES
        ).json()["results"]
        assert [(x["status"], x["duplicate"]) for x in again] == [(200, True), (200, True)]
        assert len(_steps(client)) == 10
        text = client.get("/metrics").text
        assert 'vigil_collector_batches_total{outcome="committed"} 3.0' in text
        assert 'vigil_collector_rejected_batches_total{reason="decode"} 4.0' in text


@pytest.mark.parametrize(
    ("body", "code", "detail"),
    [
        (b"", 422, "Frames.<frames>: holds no frame"),
        (b"\x00\x00", 422, "Frames.[0]: cut short inside a frame's length"),
        (b"\x00\x00\x00\x00", 422, "Frames.[0]: is empty"),
        (b"\x00\x00\x00\x09VGL", 422, "Frames.[0]: declares 9 bytes, 3 remain"),
        (b"\x00\x00\x00\x01V" * 4097, 413, "Frames.<frames>: more than the limit of 4096 frames"),
        (b"\x00" * (65 * 1024), 413, "Batch.<frame>: body exceeds the 65536 byte limit"),
    ],
)
def test_a_body_that_is_not_an_envelope_is_refused_whole(
    client: TestClient, body: bytes, code: int, detail: str
) -> None:
    r = client.post(api.INGEST_FRAMES_PATH, content=body, headers=FRAMES)
    assert r.status_code == code and r.json()["detail"].startswith(detail), r.text
    assert _steps(client) == []


def test_frames_that_inflate_past_the_limit_together_are_refused(make_client: MakeClient) -> None:
    client = make_client(max_batch_inflated_bytes=20_000)
    frames = [codec.encode_batch(rec.steps(50, 1, first=i), batch_id=f"i-{i}") for i in range(4)]
    each = codec.inflated_size(frames[0])
    assert 5_000 < each < 20_000  # one alone is within the limit, four together are not
    r = client.post(api.INGEST_FRAMES_PATH, content=codec.encode_frames(frames), headers=FRAMES)
    assert r.status_code == 413 and "send fewer per request" in r.json()["detail"]
    r = client.post(api.INGEST_FRAMES_PATH, content=codec.encode_frames(frames[:1]), headers=FRAMES)
    assert [x["status"] for x in r.json()["results"]] == [200]


def test_media_type_and_tokens_are_checked_as_for_one_batch(make_client: MakeClient) -> None:
    client = make_client(ingest_tokens="in-tok")
    body = codec.encode_frames([codec.encode_batch(rec.steps(1, 1))])
    r = client.post(api.INGEST_FRAMES_PATH, content=body, headers=FRAMES)
    assert r.status_code == 401
    auth = {"Authorization": "Bearer in-tok"}
    r = client.post(api.INGEST_FRAMES_PATH, content=body, headers={**LONE, **auth})
    assert r.status_code == 415 and api.FRAMES_MEDIA_TYPE in r.json()["detail"]
    r = client.post(api.INGEST_FRAMES_PATH, content=body, headers={**FRAMES, **auth})
    assert r.status_code == 200 and r.json()["results"][0]["status"] == 200


def test_frames_reach_the_analyzer_each_once(make_client: MakeClient) -> None:
    seen: list[str] = []

    class Recording:
        def observe(self, records: object, steps: object = None) -> list[schema.Finding]:
            seen.append(f"{len(records)}+{0 if steps is None else len(steps)}")  # type: ignore[arg-type]
            return []

    client = make_client(analyzer=Recording())
    frames = [codec.encode_batch(rec.steps(1, 3, first=3 * i), batch_id=f"a-{i}") for i in range(3)]
    r = client.post(
        api.INGEST_FRAMES_PATH, content=codec.encode_frames([*frames, frames[0]]), headers=FRAMES
    )
    assert [x["status"] for x in r.json()["results"]] == [200] * 4
    runner = client.app.state.collector.runner  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while runner.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["0+3"] * 3  # each committed batch, its step records as columns; no duplicate
