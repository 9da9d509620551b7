"""Hostile and absurd input: valid-looking requests must cost bounded memory and work."""

from __future__ import annotations

import gc
import gzip
import json
import socket
import time
import tracemalloc
import weakref
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.collector import records as rec
from tests.collector.conftest import MakeClient
from tests.collector.test_crash import Collector, _free_port
from vigil import api, codec, schema
from vigil.collector import kineto, routes_ingest

pytestmark = pytest.mark.integration
HEADERS = {"content-type": api.BATCH_MEDIA_TYPE}


def _post(client: TestClient, records: list[schema.Record], **headers: str) -> tuple[int, str]:
    r = client.post(
        api.INGEST_PATH, content=codec.encode_batch(records), headers={**HEADERS, **headers}
    )
    return r.status_code, r.text


def test_ranks_lie_below_the_declared_world_size(make_client: MakeClient) -> None:
    client = make_client(max_world_size=1024)
    job = schema.Job(job_id="w", world_size=4)
    assert _post(client, [job])[0] == 200
    status, text = _post(client, [rec.step(4, 0, job="w")])
    assert status == 422 and "rank 4 is not below world size 4 (job 'w' declared)" in text
    beat = schema.Heartbeat(job_id="w", rank=7, time_s=1.0)
    status, text = _post(client, [beat])
    assert status == 422 and text.startswith('{"detail":"Heartbeat.rank')
    assert _post(client, [rec.step(3, 0, job="w")])[0] == 200
    # Undeclared jobs are held to the collector's limit; declared sizes to it as well.
    status, text = _post(client, [rec.step(1024, 0, job="other")])
    assert status == 422 and "no declared size for job 'other'" in text
    status, text = _post(client, [schema.Job(job_id="huge", world_size=200_000)])
    assert status == 422 and "Job.world_size" in text and "VIGIL_MAX_WORLD_SIZE" in text
    # A rank's own RankInfo declares the size too (per-rank senders, before rank 0's Job).
    info = schema.RankInfo(job_id="r", rank=1, node="n", world_size=2)
    assert _post(client, [info, rec.step(1, 0, job="r")])[0] == 200
    assert _post(client, [rec.step(2, 0, job="r")])[0] == 422


def test_jobs_known_only_from_their_ranks_are_listed(make_client: MakeClient) -> None:
    client = make_client()
    assert _post(client, [rec.step(0, 0, job="only-steps")])[0] == 200
    jobs = {j["job_id"]: j for j in client.get("/api/v1/jobs").json()}
    assert jobs["only-steps"]["world_size"] == 0  # known, size not declared yet
    job = schema.Job(job_id="only-steps", world_size=2, name="late")
    assert _post(client, [job])[0] == 200
    assert client.get("/api/v1/jobs/only-steps").json()["world_size"] == 2


def test_int64_max_fits_and_nul_in_a_batch_id_is_named(make_client: MakeClient) -> None:
    client = make_client()
    big = schema.StepRecord(
        job_id="j", rank=0, step=2**53 - 1, start_s=1.0, end_s=2.0, tokens=2**63 - 1
    )
    assert _post(client, [big])[0] == 200
    status, text = _post(
        client, [schema.StepRecord(job_id="j", rank=0, step=2**53, start_s=1.0, end_s=2.0)]
    )
    assert status == 422 and "StepRecord.step: step 9007199254740992 is past" in text
    frame = codec.encode_batch([rec.step(0, 1)], batch_id="a\x00b")
    r = client.post(api.INGEST_PATH, content=frame, headers=HEADERS)
    assert r.status_code == 422 and r.json()["detail"].startswith("Batch.batch_id: must not")


def test_a_trace_upload_needs_only_the_ingest_scope(make_client: MakeClient) -> None:
    client = make_client(ingest_tokens="in", read_tokens="rd")
    trace = gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "name": "mm"}]}).encode())
    url = f"/api/v1/jobs/{rec.JOB}/traces"
    up = client.post(url, content=trace, headers={"authorization": "Bearer in"})
    assert up.status_code == 201, up.text
    assert client.post(url, content=trace, headers={"authorization": "Bearer rd"}).status_code == (
        403
    )
    assert client.post(url, content=trace).status_code == 401


def test_ops_pages_with_auth_on(make_client: MakeClient) -> None:
    client = make_client(token="t")
    assert client.get("/metrics").status_code == 200  # VIGIL_METRICS_PUBLIC defaults on
    assert client.get("/docs").status_code == 401
    assert client.get("/openapi.json").status_code == 401
    read = {"authorization": "Bearer t"}
    assert client.get("/openapi.json", headers=read).json()["info"]["title"] == "vigil collector"
    assert client.get("/docs", headers=read).status_code == 200
    closed = make_client(token="t", metrics_public=False, docs_public=True)
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/metrics", headers=read).status_code == 200
    assert closed.get("/openapi.json").status_code == 200
    assert make_client().get("/docs").status_code == 200  # auth off: everything open


def test_a_trace_bomb_costs_about_its_inflated_size() -> None:
    """Tiny events that would be millions of objects: memory stays near the inflated bytes."""
    body = b'{"traceEvents":[' + b'{"ph":"X"},' * 2_000_000 + b'{"ph":"X"}]}'
    packed = gzip.compress(body, 9)
    tracemalloc.start()
    parsed = kineto.parse(packed, max_bytes=64 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert parsed.num_events == 2_000_001
    assert peak < 2.5 * len(body), f"peak {peak / 2**20:.0f} MiB for {len(body) / 2**20:.0f} MiB"


class _Marker:
    """Something a failing request holds; freed with the request, or leaked with it."""


def test_a_server_error_keeps_no_request_data_alive(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(raise_server_exceptions=False)
    held: list[weakref.ref[_Marker]] = []

    def failing_decode(ctx: object, body: bytes) -> object:
        marker = _Marker()
        held.append(weakref.ref(marker))
        raise RuntimeError(f"a bug while holding {len(body)} bytes and {marker}")

    monkeypatch.setattr(routes_ingest, "_decode", failing_decode)
    gc.disable()
    try:
        status, text = _post(client, [rec.step(0, 0)])
        assert status == 500 and "RuntimeError" not in text  # no internals in the answer
        assert held and held[0]() is None, "the failed request's data outlived it"
    finally:
        gc.enable()


@pytest.mark.e2e
def test_half_sent_requests_are_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIGIL_HEADER_TIMEOUT_S", "1")
    port = _free_port()
    collector = Collector(f"sqlite:///{tmp_path / 'c.sqlite3'}", tmp_path, port)
    try:
        socks = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\n")  # headers never end
            socks.append(s)
        time.sleep(2.5)
        for s in socks:
            s.settimeout(2)
            assert s.recv(1) == b"", "a half-sent request was still open"
            s.close()
        with socket.create_connection(("127.0.0.1", port)) as s:  # the server still serves
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(5)
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        collector.stop()
