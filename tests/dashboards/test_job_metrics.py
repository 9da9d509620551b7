"""The collector's store-derived job series on /metrics: values from a real store (SQLite and a
throwaway PostgreSQL cluster).

Records go in through the real ingest API (as senders post them, the restart record as the
recovery controller posts it) and come out of the real /metrics page, checked by
`promtool check metrics`. Job-level series never grow with the rank count.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.collector import records as rec
from tests.support import pgcluster
from vigil import api, codec, schema
from vigil.collector import CollectorSettings, create_app

T0 = 1_700_000_000.0  # records.step starts step s at T0 + s
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


class Clock:
    def __init__(self) -> None:
        self.now_s = T0 + 20.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(scope="module")
def postgres() -> Iterator[pgcluster.PostgresServer]:
    server = pgcluster.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def collector(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[TestClient, Clock]]:
    clock = Clock()
    url = f"sqlite:///{tmp_path}/s.sqlite3"
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres").new_database()
    settings = CollectorSettings(data_dir=tmp_path, store_url=url)
    with TestClient(create_app(settings, clock=clock)) as client:
        yield client, clock


def _post(client: TestClient, records: list[schema.Record]) -> None:
    response = client.post(
        api.INGEST_PATH,
        content=codec.encode_batch(records),
        headers={"content-type": api.BATCH_MEDIA_TYPE},
    )
    assert response.status_code == 200, response.text


def _job(ranks: int, job: str = rec.JOB) -> list[schema.Record]:
    out: list[schema.Record] = [schema.Job(job_id=job, world_size=ranks)]
    out += [rec.step(r, s, job=job) for s in range(10) for r in range(ranks)]
    for r in range(ranks):
        for group in ("tp:3", "tp:5", "world"):
            out.append(
                schema.CollectiveAggregate(
                    job_id=job, rank=r, step=9, group=group, op="all_reduce", count=1,
                    total_device_s=0.1 if group != "world" else 0.05 * (r + 1),
                )
            )  # fmt: skip
    out.append(schema.Heartbeat(job_id=job, rank=0, time_s=T0 + 15.0, last_step=9))
    return out


def _recovery(job: str = rec.JOB) -> list[schema.Record]:
    crash = schema.Finding(
        finding_id=f"{job}-crash", kind=schema.FindingKind.CRASH, job_id=job, detected_s=T0 + 4.0
    )
    straggler = schema.Finding(
        finding_id=f"{job}-slow", kind=schema.FindingKind.STRAGGLER, job_id=job, detected_s=T0
    )
    restart = schema.Action(
        action_id=f"{job}-crash/0-restart", kind=schema.ActionKind.RESTART, job_id=job,
        finding_id=crash.finding_id, state=schema.ActionState.SUCCEEDED, end_s=T0 + 5.0,
        attempt=1, resume_step=4, steps_lost=1, recovered_s=T0 + 6.0,
    )  # fmt: skip
    cordon = schema.Action(
        action_id=f"{job}-slow/0-cordon", kind=schema.ActionKind.CORDON, job_id=job,
        target="node-b", state=schema.ActionState.SUCCEEDED,
    )  # fmt: skip
    ckpt = schema.Checkpoint(job_id=job, step=8, location="/ckpt/8", blocked_s=0.75)
    return [crash, straggler, restart, cordon, ckpt]


def _scrape(client: TestClient) -> tuple[str, Series]:
    text = client.get("/metrics").text
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            series.setdefault(sample.name, {})[key] = sample.value
    return text, series


Series = dict[str, dict[tuple[tuple[str, str], ...], float]]


def _one(series: Series, name: str, **labels: str) -> float:
    want = tuple(sorted({"job_id": rec.JOB, **labels}.items()))
    return series[name][want]


def test_job_series_follow_the_store(collector: tuple[TestClient, Clock], tmp_path: Path) -> None:
    client, _ = collector
    _post(client, _job(4) + _recovery())
    text, s = _scrape(client)
    assert _one(s, "vigil_collector_job_running") == 1.0
    assert _one(s, "vigil_collector_job_last_step") == 9
    assert _one(s, "vigil_collector_job_data_wait_seconds", stat="median") == pytest.approx(0.01)
    # tp:3 and tp:5 are one group kind: 0.2 s per rank; world: median of 0.05..0.2 = 0.125.
    coll = "vigil_collector_job_collective_seconds"
    assert _one(s, coll, group="tp", op="all_reduce") == pytest.approx(0.2)
    assert _one(s, coll, group="world", op="all_reduce") == pytest.approx(0.125)
    assert _one(s, "vigil_collector_checkpoint_blocked_seconds") == 0.75
    assert _one(s, "vigil_collector_findings", kind="straggler", state="open") == 1
    assert _one(s, "vigil_collector_actions", kind="restart", state="succeeded") == 1
    assert _one(s, "vigil_collector_job_restarts") == 1
    assert _one(s, "vigil_collector_job_steps_lost") == 1
    assert _one(s, "vigil_collector_job_time_to_recover_seconds") == pytest.approx(2.0)
    assert _one(s, "vigil_collector_job_nodes_excluded") == 1
    # Wall 9.5 s (step 0's start to step 9's end); lost 2 s + 1 step x 0.5 s.
    assert _one(s, "vigil_collector_job_goodput_ratio") == pytest.approx(1 - 2.5 / 9.5)
    exposition = tmp_path / "collector.prom"
    exposition.write_text(text)
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_a_silent_job_is_not_running_and_scrapes_are_cached(
    collector: tuple[TestClient, Clock],
) -> None:
    client, clock = collector
    _post(client, _job(2))
    clock.now_s = T0 + 200.0  # rank 0's last heartbeat is 185 s old
    _, first = _scrape(client)
    _post(client, [schema.Heartbeat(job_id=rec.JOB, rank=0, time_s=T0 + 199.0)])
    _, cached = _scrape(client)  # within cache_s: the same answer, no store reads
    assert _one(first, "vigil_collector_job_running") == 0.0
    assert _one(cached, "vigil_collector_job_running") == 0.0


def test_job_series_do_not_grow_with_ranks(collector: tuple[TestClient, Clock]) -> None:
    client, _ = collector
    _post(client, _job(2, job="small") + _job(64, job="large"))
    _, s = _scrape(client)
    for name, samples in s.items():
        if not name.startswith("vigil_collector_"):
            continue
        small = [k for k in samples if ("job_id", "small") in k]
        large = [k for k in samples if ("job_id", "large") in k]
        assert len(small) == len(large), name


def test_every_collector_metric_is_documented(collector: tuple[TestClient, Clock]) -> None:
    client, _ = collector
    _post(client, _job(2) + _recovery())
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        # prometheus-client's `_created` timestamps of counters and histograms (docs/metrics.md).
        if family.name.startswith("vigil_") and not family.name.endswith("_created"):
            name = family.name
            assert f"`{name}`" in doc or f"`{name}_total`" in doc, name
