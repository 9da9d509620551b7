"""The query API, auth, settings, Chrome-trace export, Kineto uploads and the analyzer hook."""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.collector import records as rec
from tests.collector.conftest import FakeClock, MakeClient
from vigil import api, cli, codec, columns, schema
from vigil.collector import CollectorSettings, DueAnalyzer, TickingAnalyzer

pytestmark = pytest.mark.integration
HEADERS = {"content-type": api.BATCH_MEDIA_TYPE}


def ingest(client: TestClient, records: Sequence[schema.Record], **headers: str) -> int:
    r = client.post(
        api.INGEST_PATH, content=codec.encode_batch(records), headers={**HEADERS, **headers}
    )
    return r.status_code


# --- settings and auth -------------------------------------------------------------------------


def test_open_binds_need_tokens_unless_dev_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"refusing to bind 0\.0\.0\.0 without tokens"):
        CollectorSettings(data_dir=tmp_path, collector_host="0.0.0.0")
    assert (
        CollectorSettings(data_dir=tmp_path, collector_host="0.0.0.0", dev_mode=True).collector_host
        == "0.0.0.0"
    )
    assert CollectorSettings(
        data_dir=tmp_path, collector_host="::", ingest_tokens="a,b"
    ).ingest_tokens == ["a", "b"]
    assert CollectorSettings(data_dir=tmp_path, collector_host="localhost").auth_enabled is False
    with pytest.raises(ValueError, match="sqlite:/// or postgresql"):
        CollectorSettings(data_dir=tmp_path, store_url="mysql://x")
    defaults = CollectorSettings(data_dir=tmp_path)
    assert defaults.resolved_store_url == f"sqlite:///{tmp_path / 'collector.sqlite3'}"


def test_settings_read_vigil_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VIGIL_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("VIGIL_READ_TOKENS", "r1, r2")
    monkeypatch.setenv("VIGIL_STORE_URL", "postgresql://u@db/vigil")
    s = CollectorSettings()
    assert s.read_tokens == ["r1", "r2"] and s.store_url == "postgresql+psycopg://u@db/vigil"


def test_bearer_tokens_with_ingest_and_read_scopes(make_client: MakeClient) -> None:
    client = make_client(ingest_tokens="in-1", read_tokens="rd-1")
    frame = codec.encode_batch(rec.steps(1, 1))
    no_token = client.post(api.INGEST_PATH, content=frame, headers=HEADERS)
    assert no_token.status_code == 401 and no_token.headers["www-authenticate"] == "Bearer"
    assert ingest(client, rec.steps(1, 1), authorization="Bearer rd-1") == 403
    assert ingest(client, rec.steps(1, 1), authorization="Bearer in-1") == 200
    assert client.get("/api/v1/jobs").status_code == 401
    assert client.get("/api/v1/jobs", headers={"authorization": "Bearer in-1"}).status_code == 403
    jobs = client.get("/api/v1/jobs", headers={"authorization": "Bearer rd-1"})
    assert jobs.status_code == 200
    assert client.get("/healthz").json() == {"status": "ok", "store": "sqlite"}
    assert 'reason="auth"' in client.get("/metrics").text


def test_the_shared_token_grants_both_scopes(make_client: MakeClient) -> None:
    client = make_client(token="shared")
    assert ingest(client, rec.steps(1, 1), authorization="Bearer shared") == 200
    assert client.get("/api/v1/jobs", headers={"authorization": "Bearer shared"}).status_code == 200


# --- queries -----------------------------------------------------------------------------------


def test_job_queries_and_404s(make_client: MakeClient) -> None:
    client = make_client()
    job = schema.Job(job_id=rec.JOB, world_size=4, created_s=1.0)
    beats = [
        schema.Heartbeat(job_id=rec.JOB, rank=r, time_s=time.time(), last_step=9) for r in range(4)
    ]
    assert ingest(client, [job, *rec.steps(4, 10), *beats]) == 200
    assert [j["job_id"] for j in client.get("/api/v1/jobs").json()] == [rec.JOB]
    state = client.get(f"/api/v1/jobs/{rec.JOB}/state").json()
    assert (
        state["last_step"] == 9 and len(state["ranks"]) == 4 and state["ranks"][0]["silent_s"] < 60
    )
    assert client.get("/api/v1/jobs/nope").status_code == 404
    assert client.get("/api/v1/jobs/nope/state").json() == {"detail": "no job 'nope'"}
    # Without a range the step endpoints serve the job's latest steps.
    assert {s["step"] for s in client.get(f"/api/v1/jobs/{rec.JOB}/steps").json()} == set(range(10))
    by_rank = client.get(f"/api/v1/jobs/{rec.JOB}/steps/by-rank").json()
    assert [r["num_steps"] for r in by_rank] == [10] * 4
    heat = client.get(
        f"/api/v1/jobs/{rec.JOB}/heatmap", params={"metric": "mfu", "max_steps": 5}
    ).json()
    assert heat["steps"] == [5, 6, 7, 8, 9] and heat["values"][0] == [0.4] * 4
    bad = client.get(f"/api/v1/jobs/{rec.JOB}/steps", params={"step_start": 5, "step_end": 2})
    assert bad.status_code == 422 and "before step_start" in bad.json()["detail"]
    assert (
        client.get(f"/api/v1/jobs/{rec.JOB}/heatmap", params={"metric": "speed"}).status_code == 422
    )
    assert (
        client.get("/api/v1/samples", params={"metric": "x", "start_s": 5, "end_s": 1}).status_code
        == 422
    )


def test_heatmap_of_missing_cells_is_null_in_json(make_client: MakeClient) -> None:
    """Ranks that never reported in the range are not columns; a listed rank's missing step
    is null."""
    client = make_client()
    ingest(client, [rec.step(0, 0), rec.step(2, 0), rec.step(2, 1)])
    heat = client.get(f"/api/v1/jobs/{rec.JOB}/heatmap").json()
    assert heat["ranks"] == [0, 2] and heat["values"] == [[0.5, 0.5], [None, 0.5]]


def test_heatmap_of_a_lone_high_rank_is_one_column(make_client: MakeClient) -> None:
    """One rank near the largest allowed: 40 steps answer 40 cells, not 40 x 131,072 nulls."""
    client = make_client()
    assert ingest(client, [rec.step(131_071, s) for s in range(40)]) == 200
    r = client.get(f"/api/v1/jobs/{rec.JOB}/heatmap", params={"max_steps": 40})
    heat = r.json()
    assert heat["ranks"] == [131_071] and heat["steps"] == list(range(40))
    assert heat["values"] == [[0.5]] * 40 and len(r.content) < 2_000


def test_findings_actions_checkpoints_diag_and_collectives(make_client: MakeClient) -> None:
    client = make_client()
    ingest(
        client,
        [
            schema.Finding(
                finding_id="f1", kind=schema.FindingKind.HANG, job_id=rec.JOB, detected_s=2.0
            ),
            schema.Finding(
                finding_id="f2", kind=schema.FindingKind.STRAGGLER, job_id="other", detected_s=1.0
            ),
            schema.Action(
                action_id="a1", kind=schema.ActionKind.DUMP_STACKS, job_id=rec.JOB, finding_id="f1"
            ),
            schema.Checkpoint(job_id=rec.JOB, step=100, location="s3://b/100"),
            schema.DiagResult(node="n1", device="0", test="nccl_busbw", value=180.0, unit="GB/s"),
            schema.CollectiveAggregate(
                job_id=rec.JOB, rank=0, step=0, group="tp", op="all_gather", count=2, bytes=64
            ),
            rec.step(0, 0),
        ],
    )
    assert [f["finding_id"] for f in client.get("/api/v1/findings").json()] == ["f1", "f2"]
    assert [f["kind"] for f in client.get(f"/api/v1/jobs/{rec.JOB}/findings").json()] == ["hang"]
    assert (
        client.get("/api/v1/findings", params={"kind": "straggler"}).json()[0]["job_id"] == "other"
    )
    assert client.get("/api/v1/actions", params={"job_id": rec.JOB}).json()[0]["finding_id"] == "f1"
    assert client.get(f"/api/v1/jobs/{rec.JOB}/checkpoints").json()[0]["location"] == "s3://b/100"
    assert client.get("/api/v1/diag", params={"node": "n1"}).json()[0]["unit"] == "GB/s"
    coll = client.get(f"/api/v1/jobs/{rec.JOB}/collectives", params={"by_rank": True}).json()
    assert coll[0] | {} == coll[0] and (coll[0]["group"], coll[0]["rank"], coll[0]["bytes"]) == (
        "tp",
        0,
        64,
    )


def test_restart_action_is_upserted_with_its_restart_record(make_client: MakeClient) -> None:
    """A restart posted at relaunch, then again (same id) once the new attempt's first step is
    seen: the API answers one action carrying the second post's record."""
    client = make_client()
    restart = schema.Action(
        action_id="r1",
        kind=schema.ActionKind.RESTART,
        job_id=rec.JOB,
        finding_id="crash-1",
        state=schema.ActionState.SUCCEEDED,
        start_s=10.0,
        end_s=11.0,
        attempt=1,
    )
    assert ingest(client, [restart]) == 200
    (first,) = client.get("/api/v1/actions", params={"job_id": rec.JOB}).json()
    assert (first["attempt"], first["resume_step"], first["steps_lost"]) == (1, -1, -1)
    assert first["recovered_s"] == 0.0
    done = msgspec.structs.replace(restart, resume_step=11, steps_lost=2, recovered_s=14.5)
    assert ingest(client, [done]) == 200
    (action,) = client.get("/api/v1/actions", params={"job_id": rec.JOB}).json()
    assert (action["attempt"], action["resume_step"], action["steps_lost"]) == (1, 11, 2)
    assert action["recovered_s"] == 14.5 and action["finding_id"] == "crash-1"
    # Other actions carry the "unknown" values.
    other = schema.Action(action_id="c1", kind=schema.ActionKind.CHECKPOINT, job_id=rec.JOB)
    assert ingest(client, [other]) == 200
    by_id = {a["action_id"]: a for a in client.get("/api/v1/actions").json()}
    assert (by_id["c1"]["attempt"], by_id["c1"]["steps_lost"]) == (-1, -1)
    spec = client.get("/openapi.json").json()["components"]["schemas"]["ActionPublic"]
    assert {"attempt", "resume_step", "steps_lost", "recovered_s"} <= set(spec["properties"])


def test_openapi_documents_every_route(make_client: MakeClient) -> None:
    spec = make_client().get("/openapi.json").json()
    paths = set(spec["paths"])
    for path in (
        "/api/v1/ingest",
        "/api/v1/jobs/{job_id}/heatmap",
        "/api/v1/jobs/{job_id}/trace",
        "/api/v1/jobs/{job_id}/traces",
        "/api/v1/samples",
        "/api/v1/findings",
        "/metrics",
    ):
        assert path in paths
    heatmap = spec["paths"]["/api/v1/jobs/{job_id}/heatmap"]["get"]
    assert heatmap["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "HeatmapPublic"
    )


# --- traces ------------------------------------------------------------------------------------


def _check_chrome_trace(doc: dict[str, object]) -> list[dict[str, object]]:
    """The shape Perfetto's JSON importer and chrome://tracing accept (Trace Event Format)."""
    assert set(doc) >= {"traceEvents", "displayTimeUnit"} and doc["displayTimeUnit"] in ("ms", "ns")
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert isinstance(e, dict) and e["ph"] in ("X", "M")
        assert (
            isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        )
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0
        else:
            assert e["name"] in ("process_name", "thread_name", "process_sort_index")
            assert isinstance(e["args"], dict)
    return events


def test_chrome_trace_export_of_a_step_window(make_client: MakeClient, store_url: str) -> None:
    client = make_client(store_url=store_url)
    events = [
        schema.CollectiveEvent(
            job_id=rec.JOB,
            rank=r,
            group="dp",
            seq=1,
            op="all_reduce",
            step=1,
            start_s=1_700_000_001.3,
            end_s=1_700_000_001.4,
            bytes=1 << 20,
        )
        for r in range(2)
    ]
    ingest(
        client, [schema.RankInfo(job_id=rec.JOB, rank=1, node="node-b"), *rec.steps(2, 4), *events]
    )
    r = client.get(f"/api/v1/jobs/{rec.JOB}/trace", params={"step_start": 1, "step_end": 2})
    assert r.status_code == 200
    doc = json.loads(r.content)
    trace_events = _check_chrome_trace(doc)
    steps = [e for e in trace_events if e.get("cat") == "step"]
    assert sorted((e["pid"], e["name"]) for e in steps) == [
        (0, "step 1"),
        (0, "step 2"),
        (1, "step 1"),
        (1, "step 2"),
    ]
    assert all(e["dur"] == pytest.approx(500_000) for e in steps)
    first = min(steps, key=lambda e: (e["ts"], e["pid"]))
    assert first["ts"] == 0 and doc["otherData"]["origin_s"] == pytest.approx(1_700_000_001.0)
    phases = [
        e
        for e in trace_events
        if e.get("cat") == "phase" and e["pid"] == 0 and e["args"]["step"] == 1
    ]
    assert [p["name"] for p in phases] == [
        "data",
        "forward",
        "backward",
        "optimizer",
        "exposed comm wait",
    ]
    colls = [e for e in trace_events if e.get("cat") == "collective"]
    assert (
        len(colls) == 2
        and colls[0]["ts"] == pytest.approx(300_000)
        and colls[0]["dur"] == pytest.approx(100_000, rel=1e-3)
    )
    names = {e["args"]["name"] for e in trace_events if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1 (node-b)"}


def test_kineto_trace_upload_round_trip(make_client: MakeClient) -> None:
    client = make_client()
    trace = {
        "schemaVersion": 1,
        "traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 0, "tid": 0}],
    }
    body = gzip.compress(json.dumps(trace).encode())
    up = client.post(
        f"/api/v1/jobs/{rec.JOB}/traces",
        params={"rank": 3, "name": "rank3.pt.trace.json.gz"},
        content=body,
        headers={"content-type": "application/gzip"},
    )
    assert up.status_code == 201, up.text
    info = up.json()
    assert (info["rank"], info["num_events"]) == (3, 1)
    listed = client.get(f"/api/v1/jobs/{rec.JOB}/traces").json()
    assert [t["trace_id"] for t in listed] == [info["trace_id"]]
    assert json.loads(client.get(f"/api/v1/traces/{info['trace_id']}").content) == trace
    assert client.get("/api/v1/traces/unknown").status_code == 404
    bad = client.post(f"/api/v1/jobs/{rec.JOB}/traces", content=b'{"events": []}')
    assert bad.status_code == 422 and "traceEvents" in bad.json()["detail"]
    bomb = gzip.compress(b" " * (2 << 20))
    small = make_client(max_trace_bytes=1 << 20)
    assert (
        small.post(f"/api/v1/jobs/{rec.JOB}/traces", content=bomb)
        .json()["detail"]
        .startswith("trace inflates beyond")
    )


# --- the analyzer hook -------------------------------------------------------------------------


class SlowRankAnalyzer:
    """A stand-in for vigil.analyzer.StreamingAnalyzer: flags steps slower than 1 s."""

    def __init__(self) -> None:
        self.batches = 0
        self.ticks: list[float] = []

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        self.batches += 1
        # The collector hands over the batch's step records as columns (they travel as a
        # columnar block, so `records` holds the others only).
        assert not any(isinstance(r, schema.StepRecord) for r in records)
        if any(isinstance(r, schema.Sample) for r in records):
            raise RuntimeError("analyzer bug")
        if steps is None:
            return []
        slow = steps.column("end_s") - steps.column("start_s") > 1.0
        return [
            schema.Finding(
                finding_id=f"slow-{rank}-{step}",
                kind=schema.FindingKind.STRAGGLER,
                job_id=job,
                subjects=schema.Subjects(ranks=[rank]),
                step_start=step,
                step_end=step,
            )
            for job, rank, step in zip(
                np.array(steps.job_ids)[slow].tolist(),
                steps.column("rank")[slow].astype(int).tolist(),
                steps.column("step")[slow].astype(int).tolist(),
                strict=True,
            )
        ]

    def tick(self, now_s: float) -> Sequence[schema.Finding]:
        self.ticks.append(now_s)
        return []


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_analyzer_sees_committed_batches_and_its_findings_are_served(
    make_client: MakeClient,
) -> None:
    analyzer = SlowRankAnalyzer()
    assert isinstance(analyzer, TickingAnalyzer)
    client = make_client(analyzer=analyzer, analyzer_tick_s=0.05)
    assert ingest(client, [rec.step(0, 1), rec.step(1, 1, seconds=3.0)]) == 200
    _wait_for(lambda: len(client.get("/api/v1/findings").json()) == 1)
    (finding,) = client.get(f"/api/v1/jobs/{rec.JOB}/findings").json()
    assert finding["subjects"] == {"ranks": [1]} and finding["kind"] == "straggler"
    # An analyzer failure is counted; the batch is still acknowledged and stored.
    assert ingest(client, [rec.sample("n1", 1.0, 1.0)]) == 200
    _wait_for(lambda: "vigil_collector_analyzer_errors_total 1.0" in client.get("/metrics").text)
    assert client.get(
        "/api/v1/samples", params={"metric": "gpu_util", "start_s": 0, "end_s": 10}
    ).json()["series"]
    _wait_for(lambda: len(analyzer.ticks) >= 2)
    # Duplicates are not analysed twice.
    frame = codec.encode_batch([rec.step(2, 1)], batch_id="once")
    for _ in range(2):
        client.post(api.INGEST_PATH, content=frame, headers=HEADERS)
    _wait_for(lambda: analyzer.batches == 3)
    time.sleep(0.2)
    assert analyzer.batches == 3


class DueSoonAnalyzer:
    """Says a tick is due 0.5 s after each batch it sees; records when it is ticked."""

    def __init__(self) -> None:
        self.due: float | None = None
        self.ticks: list[float] = []

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        self.due = time.time() + 0.5
        return []

    def tick(self, now_s: float) -> Sequence[schema.Finding]:
        self.ticks.append(now_s)
        return []

    def due_s(self) -> float | None:
        return self.due


def test_the_analyzer_is_ticked_when_it_says_a_hang_could_be_due(make_client: MakeClient) -> None:
    """Ticks come every `analyzer_tick_s` (here a minute) and at the analyzer's `due_s` when
    that is sooner: a hang's silence passing its threshold is checked then, not up to a tick
    later."""
    analyzer = DueSoonAnalyzer()
    assert isinstance(analyzer, DueAnalyzer)
    client = make_client(analyzer=analyzer, analyzer_tick_s=60.0)
    time.sleep(1.0)
    assert analyzer.ticks == []  # nothing due yet, and the minute has not passed
    assert ingest(client, [rec.step(0, 1)]) == 200
    _wait_for(lambda: analyzer.due is not None)
    due = analyzer.due
    assert due is not None
    _wait_for(lambda: len(analyzer.ticks) == 1, timeout_s=5.0)
    assert due <= analyzer.ticks[0] < due + 0.5
    time.sleep(1.0)
    assert len(analyzer.ticks) == 1  # a due time that has passed brings no more ticks


def test_vigil_collector_refuses_an_open_bind_without_tokens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VIGIL_DATA_DIR", str(tmp_path))
    root = logging.getLogger("vigil")  # cli.main configures it; undo that after the test
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # cli mutates this copy in place
    monkeypatch.setattr(root, "propagate", root.propagate)
    monkeypatch.setattr(root, "level", root.level)
    assert cli.main(["collector", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to bind 0.0.0.0 without tokens" in capsys.readouterr().err


def test_the_maintenance_loop_rolls_up_and_expires_raw_samples(make_client: MakeClient) -> None:
    clock = FakeClock()
    client = make_client(clock=clock, maintenance_interval_s=0.05, raw_retention_s=3600.0)
    assert ingest(client, [rec.sample("n1", 60.0 + i, float(i)) for i in range(60)]) == 200
    clock.now_s += 7200.0  # two hours later the raw samples are past retention
    params = {"metric": "gpu_util", "start_s": 0, "end_s": 3600, "points": 1}
    _wait_for(
        lambda: (
            client.get("/api/v1/samples", params={**params, "points": 3600}).json()["series"] == []
        )
    )
    (series,) = client.get("/api/v1/samples", params=params).json()["series"]
    assert series["points"] == [{"time_s": 0.0, "mean": 29.5, "min": 0.0, "max": 59.0, "count": 60}]
