"""The web UI's server side without a browser, on SQLite and a real PostgreSQL server: the heat
map keeps the worst cell through downsampling (and the query API's mean stays the default), rows
grouped by node or a parallel coordinate, pages carry a Content-Security-Policy and no data,
/ui/api needs the read token."""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from tests.collector import records as rec
from tests.support import pgcluster
from vigil import api, codec, schema
from vigil.collector import CollectorSettings, create_app
from vigil.collector.ui import cells

HEADERS = {"content-type": api.BATCH_MEDIA_TYPE}


def _client(tmp_path: Path, store_url: str = "", **fields: object) -> TestClient:
    settings = CollectorSettings(
        data_dir=tmp_path,
        store_url=store_url or f"sqlite:///{tmp_path / 'ui.sqlite3'}",
        **fields,  # type: ignore[arg-type]
    )
    return TestClient(create_app(settings))


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[pgcluster.PostgresServer]:
    server = pgcluster.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with _client(tmp_path) as c:
        yield c


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    """The heat map's reads on both stores (PostgreSQL's go through its binary protocol)."""
    url = ""
    if request.param == "postgresql":
        server: pgcluster.PostgresServer = request.getfixturevalue("postgres_server")
        url = server.new_database()
    with _client(tmp_path, url) as c:
        yield c


def _post(client: TestClient, records: list[schema.Record], **headers: str) -> None:
    r = client.post(api.INGEST_PATH, content=codec.encode_batch(records), headers=HEADERS | headers)
    assert r.status_code == 200, r.text


def _job(world: int, layout: schema.ParallelLayout | None = None) -> schema.Job:
    return schema.Job(
        job_id=rec.JOB, name=rec.JOB, world_size=world, layout=layout or schema.ParallelLayout()
    )


def _heat(client: TestClient, **params: object) -> tuple[dict[str, object], list[list[float]]]:
    r = client.get(f"/ui/api/jobs/{rec.JOB}/heatmap", params=params)
    assert r.status_code == 200, r.text
    header, values = cells.decode(r.content)
    return header, values.tolist()


def test_one_slow_cell_survives_downsampling_of_both_axes(stores: TestClient) -> None:
    # 64 ranks x 200 steps of 0.5 s; rank 37 took 3 s at step 123 only.
    slow = {(37, 123)}
    records: list[schema.Record] = [_job(64)]
    records += [
        rec.step(r, s, seconds=3.0 if (r, s) in slow else 0.5)
        for s in range(200)
        for r in range(64)
    ]
    _post(stores, records)
    header, values = _heat(stores, max_cols=20, max_rows=8)
    assert (header["step_stride"], header["rank_stride"]) == (10, 8)
    assert (header["num_cols"], header["num_rows"]) == (20, 8)
    col, row = 123 // 10, 37 // 8
    assert values[col][row] == pytest.approx(3.0)
    others = [
        v for c, line in enumerate(values) for r, v in enumerate(line) if (c, r) != (col, row)
    ]
    assert max(others) == pytest.approx(0.5)
    assert header["medians"][col] == pytest.approx(0.5)  # over all 64 ranks of the column
    # The query API's default is unchanged: the mean over the column's 10 steps.
    mean = stores.get(
        f"/api/v1/jobs/{rec.JOB}/heatmap", params={"max_steps": 20, "step_start": 0}
    ).json()
    assert mean["stride"] == 10
    assert mean["values"][col][37] == pytest.approx((9 * 0.5 + 3.0) / 10)


def test_mfu_keeps_the_lowest_and_compute_is_step_minus_wait(stores: TestClient) -> None:
    records: list[schema.Record] = [_job(4)]
    for s in range(10):
        for r in range(4):
            low = (r, s) == (2, 7)
            records.append(rec.step(r, s, seconds=0.5, wait=0.1, mfu=0.1 if low else 0.4))
    _post(stores, records)
    header, values = _heat(stores, metric="mfu", max_cols=2)
    assert header["worst"] == "min" and values[1][2] == pytest.approx(0.1)
    assert values[0][2] == pytest.approx(0.4)
    _, compute = _heat(stores, metric="compute")
    assert compute[3][1] == pytest.approx(0.4)


def test_rows_grouped_by_node_and_by_parallel_coordinate(client: TestClient) -> None:
    layout = schema.ParallelLayout(dp=2, tp=2)
    records: list[schema.Record] = [_job(4, layout)]
    records += [
        schema.RankInfo(job_id=rec.JOB, rank=r, node=f"node-{'ab'[r % 2]}", world_size=4)
        for r in range(4)
    ]
    records += [rec.step(r, s) for s in range(3) for r in range(4)]
    _post(client, records)
    by_node, _ = _heat(client, group="node")
    assert by_node["ranks"] == [0, 2, 1, 3]
    assert [(g["label"], g["row_start"], g["row_end"]) for g in by_node["groups"]] == [  # type: ignore[union-attr]
        ("node-a", 0, 1),
        ("node-b", 2, 3),
    ]
    by_dp, _ = _heat(client, group="dp")  # tp fastest: ranks 0, 1 are dp 0
    assert by_dp["ranks"] == [0, 1, 2, 3]
    by_tp, _ = _heat(client, group="tp")
    assert by_tp["ranks"] == [0, 2, 1, 3]
    window, values = _heat(client, group="tp", row_start=2, row_end=3, step_start=1, step_end=2)
    assert window["ranks"] == [1, 3] and len(values) == 2 and len(values[0]) == 2


def test_row_table_metrics_and_bad_windows(stores: TestClient) -> None:
    records: list[schema.Record] = [_job(2)]
    for s in range(4):
        for r in range(2):
            records.append(
                msgspec.structs.replace(rec.step(r, s), peak_memory_bytes=(r + 1) * 1000 + s)
            )
            records.append(
                schema.CollectiveAggregate(
                    job_id=rec.JOB,
                    rank=r,
                    step=s,
                    group="world",
                    op="all_reduce",
                    count=2,
                    bytes=1024,
                    total_device_s=0.01 * (r + 1),
                    max_device_s=0.01,
                )
            )
    _post(stores, records)
    header, memory = _heat(stores, metric="peak_memory", max_cols=2)
    assert header["unit"] == "B" and memory[1] == [1003.0, 2003.0]
    _, coll = _heat(stores, metric="collective")
    assert coll[0] == pytest.approx([0.01, 0.02])
    bad = stores.get(f"/ui/api/jobs/{rec.JOB}/heatmap", params={"step_start": 5, "step_end": 2})
    assert bad.status_code == 422 and "before" in bad.json()["detail"]
    assert stores.get(f"/ui/api/jobs/{rec.JOB}/heatmap", params={"metric": "x"}).status_code == 422


def test_cell_drill_down_names_the_median_rank_and_collectives(stores: TestClient) -> None:
    records: list[schema.Record] = [_job(5)]
    records += [rec.step(r, s, seconds=0.5 + 0.1 * r) for s in range(3) for r in range(5)]
    records.append(
        schema.CollectiveAggregate(
            job_id=rec.JOB,
            rank=4,
            step=1,
            group="world",
            op="all_reduce",
            count=3,
            bytes=4096,
            total_device_s=0.2,
            max_device_s=0.1,
            total_wait_s=0.05,
        )
    )
    _post(stores, records)
    body = stores.get(f"/ui/api/jobs/{rec.JOB}/cell", params={"rank": 4, "step": 1}).json()
    assert body["median_rank"] == 2 and body["median_record"]["rank"] == 2
    assert body["record"]["end_s"] - body["record"]["start_s"] == pytest.approx(0.9)
    (coll,) = body["collectives"]
    assert (coll["group"], coll["op"], coll["count"], coll["bytes"]) == (
        "world",
        "all_reduce",
        3,
        4096,
    )


def test_trace_download_is_a_gzipped_chrome_trace(client: TestClient) -> None:
    _post(client, [_job(2), *rec.steps(2, 6)])
    r = client.get(f"/ui/api/jobs/{rec.JOB}/trace.json.gz", params={"step_start": 1, "step_end": 3})
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    assert "attachment" in r.headers["content-disposition"]
    trace = json.loads(gzip.decompress(r.content))
    steps = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "step"}
    assert steps == {"step 1", "step 2", "step 3"} and {e["pid"] for e in trace["traceEvents"]} == {
        0,
        1,
    }
    wide = client.get(
        f"/ui/api/jobs/{rec.JOB}/trace.json.gz", params={"step_start": 0, "step_end": 500}
    )
    assert wide.status_code == 413


def test_pages_carry_a_csp_and_no_data(client: TestClient) -> None:
    name = "<img src=x onerror=alert(1)>"
    _post(client, [msgspec.structs.replace(_job(1), name=name), rec.step(0, 0)])
    home = client.get("/", follow_redirects=False)
    assert home.status_code == 307 and home.headers["location"] == "/ui/"
    page = client.get("/ui/jobs/" + rec.JOB, params={"metric": "wait", "step": 3, "rank": 0})
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert rec.JOB not in page.text and name not in page.text  # the shell holds no data
    assert "<script>" not in page.text and "http" not in page.text  # no inline script, no CDN
    for asset in ("common.js", "heatmap.js", "job.js", "vigil.css"):
        r = client.get(f"/ui/static/{asset}")
        assert r.status_code == 200 and "content-security-policy" in r.headers
    scripts = "".join(
        client.get(f"/ui/static/{a}").text for a in ("common.js", "jobs.js", "job.js")
    )
    scripts += client.get("/ui/static/heatmap.js").text + client.get("/ui/static/charts.js").text
    # Markup is never built from strings: no HTML sinks, no eval.
    assert not re.search(
        r"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write|eval\(", scripts
    )
    assert "content-security-policy" not in client.get("/healthz").headers


def test_ui_data_needs_the_read_token(tmp_path: Path) -> None:
    with _client(tmp_path, read_tokens=["r-secret"], ingest_tokens=["i-secret"]) as c:
        _post(c, [_job(1), rec.step(0, 0)], authorization="Bearer i-secret")
        assert c.get("/ui/").status_code == 200  # the shell: no data, no token needed
        assert c.get("/ui/api/jobs").status_code == 401
        assert (
            c.get("/ui/api/jobs", headers={"authorization": "Bearer i-secret"}).status_code == 403
        )
        ok = c.get("/ui/api/jobs", headers={"authorization": "Bearer r-secret"})
        assert ok.status_code == 200 and ok.json()[0]["job_id"] == rec.JOB
        # A token in the query string is not a token.
        assert c.get("/ui/api/jobs", params={"token": "r-secret"}).status_code == 401


def test_jobs_list_figures(client: TestClient) -> None:
    records: list[schema.Record] = [_job(4)]
    records += [rec.step(r, s, seconds=0.5, mfu=0.25) for s in range(30) for r in range(4)]
    records.append(
        schema.Finding(
            finding_id="f-1",
            kind=schema.FindingKind.STRAGGLER,
            job_id=rec.JOB,
            summary="rank 1 slow",
            confidence=0.9,
        )
    )
    _post(client, records)
    (job,) = client.get("/ui/api/jobs").json()
    assert job["last_step"] == 29 and job["world_size"] == 4 and job["open_findings"] == 1
    assert job["step_time_p50_s"] == pytest.approx(0.5) and job["mfu"] == pytest.approx(0.25)
    assert job["tokens_per_s"] == pytest.approx(4 * 1000 / 0.5)
    assert math.isclose(job["last_seen_s"], 1_700_000_029.5)


def test_worst_of_columns_when_steps_are_missing(stores: TestClient) -> None:
    # Steps 0..19 without 7 (a step no rank reported): columns of 4 steps, the slow cell kept.
    records: list[schema.Record] = [_job(3)]
    records += [
        rec.step(r, s, seconds=2.0 if (r, s) == (1, 9) else 0.5)
        for s in range(20)
        if s != 7
        for r in range(3)
    ]
    _post(stores, records)
    header, values = _heat(stores, max_cols=5)
    assert header["step_stride"] == 4 and header["steps"] == [0, 4, 8, 12, 16]
    assert values[2] == pytest.approx([0.5, 2.0, 0.5])
    assert all(v == pytest.approx(0.5) for c in (0, 1, 3, 4) for v in values[c])


def test_recovery_timeline_from_findings_and_actions(client: TestClient) -> None:
    """detected -> actions in order -> resumed, from the action that relaunched the job."""
    finding = schema.Finding(
        finding_id="f-slow",
        kind=schema.FindingKind.STRAGGLER,
        job_id=rec.JOB,
        summary="rank 2 slow",
        detected_s=1000.0,
    )

    def action(kind: schema.ActionKind, at: float, **extra: Any) -> schema.Action:
        return schema.Action(
            action_id=f"a-{kind}",
            kind=kind,
            job_id=rec.JOB,
            finding_id="f-slow",
            state=schema.ActionState.SUCCEEDED,
            start_s=at,
            end_s=at + 1,
            **extra,
        )

    _post(
        client,
        [
            _job(4),
            rec.step(0, 0),
            finding,
            action(
                schema.ActionKind.MIGRATE, 1003.0, resume_step=16, steps_lost=2, recovered_s=1012.5
            ),
            action(schema.ActionKind.CHECKPOINT, 1001.0),
        ],
    )
    (timeline,) = client.get(f"/ui/api/jobs/{rec.JOB}").json()["recovery"]
    assert [a["kind"] for a in timeline["actions"]] == ["checkpoint", "migrate"]
    assert timeline["time_to_recover_s"] == pytest.approx(12.5)
    assert (timeline["resume_step"], timeline["steps_lost"]) == (16, 2)
