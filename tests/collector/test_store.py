"""The store on SQLite and on a real PostgreSQL server: the same behaviour on both."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, select

from tests.collector import records as rec
from tests.collector.conftest import FakeClock
from vigil import schema
from vigil.collector import Store, heatmap, migrate, queries, retention, samples, tables, writes

pytestmark = pytest.mark.integration


def _count(store: Store, table: object) -> int:
    with store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]


def test_migrations_create_exactly_the_declared_schema(store: Store) -> None:
    with store.read() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
        diff = compare_metadata(MigrationContext.configure(conn), tables.metadata)
    assert diff == []
    assert store.migrate() == migrate.head_revision()  # idempotent at start-up


def test_a_retried_batch_is_stored_once(store: Store) -> None:
    batch = rec.batch([*rec.steps(4, 3), rec.sample("n1", 10.0, 1.0)], "batch-1")
    first = store.ingest(batch)
    again = store.ingest(batch)
    assert (first.duplicate, again.duplicate) == (False, True)
    assert first.accepted == again.accepted == 13
    assert first.counts == {"step": 12, "sample": 1}
    assert _count(store, tables.step_records) == 12
    assert _count(store, tables.samples) == 1
    assert store.batch_seen("batch-1") == 13 and store.batch_seen("nope") is None


def test_a_failing_batch_leaves_nothing_behind(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(writes._WRITERS, schema.Sample, explode)
    with pytest.raises(RuntimeError):
        store.ingest(rec.batch([*rec.steps(2, 2), rec.sample("n1", 1.0, 1.0)], "doomed"))
    assert store.batch_seen("doomed") is None
    assert _count(store, tables.step_records) == 0
    assert _count(store, tables.step_matrix) == 0
    monkeypatch.undo()
    assert not store.ingest(
        rec.batch([*rec.steps(2, 2), rec.sample("n1", 1.0, 1.0)], "doomed")
    ).duplicate
    assert _count(store, tables.step_records) == 4


def test_every_record_type_round_trips(store: Store, clock: FakeClock) -> None:
    job = schema.Job(
        job_id=rec.JOB,
        name="gpt",
        world_size=2,
        layout=schema.ParallelLayout(dp=2),
        model=schema.ModelShape(params=1000, layers=2),
        peak_flops=1e15,
        created_s=5.0,
    )
    finding = schema.Finding(
        finding_id="f-1",
        kind=schema.FindingKind.STRAGGLER,
        job_id=rec.JOB,
        subjects=schema.Subjects(ranks=[1], nodes=["n2"]),
        step_start=3,
        step_end=9,
        evidence=[schema.Evidence(metric="compute_s", observed=0.9, baseline=0.5, unit="s")],
        confidence=0.9,
        detected_s=100.0,
    )
    store.ingest(
        rec.batch(
            [
                job,
                schema.RankInfo(job_id=rec.JOB, rank=0, node="n1"),
                schema.RankInfo(job_id=rec.JOB, rank=1, node="n2", pid=42),
                *rec.steps(2, 3),
                schema.CollectiveAggregate(
                    job_id=rec.JOB,
                    rank=0,
                    step=1,
                    group="dp",
                    op="all_reduce",
                    count=3,
                    bytes=300,
                    total_wait_s=0.2,
                ),
                schema.CollectiveAggregate(
                    job_id=rec.JOB,
                    rank=1,
                    step=1,
                    group="dp",
                    op="all_reduce",
                    count=3,
                    bytes=300,
                    total_wait_s=0.0,
                ),
                schema.Heartbeat(job_id=rec.JOB, rank=0, time_s=clock.now_s - 5, last_step=2),
                schema.Heartbeat(
                    job_id=rec.JOB,
                    rank=1,
                    time_s=clock.now_s - 60,
                    last_step=1,
                    state=schema.RankState.IN_COLLECTIVE,
                ),
                finding,
                schema.Action(
                    action_id="a-1",
                    kind=schema.ActionKind.CHECKPOINT,
                    job_id=rec.JOB,
                    finding_id="f-1",
                ),
                schema.Checkpoint(
                    job_id=rec.JOB, step=2, location="/ckpt/2", bytes=10, verified=True
                ),
                schema.DiagResult(
                    node="n2",
                    device="GPU-1",
                    test="gemm_tflops",
                    value=400.0,
                    baseline=500.0,
                    verdict=schema.Verdict.SUSPECT,
                ),
            ],
            "all-types",
        )
    )
    # Upserts by id: the action finishes, the finding is acknowledged.
    store.ingest(
        rec.batch(
            [
                schema.Action(
                    action_id="a-1",
                    kind=schema.ActionKind.CHECKPOINT,
                    job_id=rec.JOB,
                    state=schema.ActionState.SUCCEEDED,
                    result="ok",
                ),
            ],
            "later",
        )
    )
    store.store_findings(
        [
            schema.Finding(
                finding_id="f-1",
                kind=schema.FindingKind.STRAGGLER,
                job_id=rec.JOB,
                state=schema.FindingState.ACKNOWLEDGED,
                detected_s=100.0,
            )
        ]
    )
    with store.read() as conn:
        got = queries.get_job(conn, rec.JOB)
        assert got is not None and got["layout"] == {"dp": 2} and got["model"]["params"] == 1000
        assert [r["node"] for r in queries.ranks(conn, rec.JOB)] == ["n1", "n2"]
        state = queries.job_state(conn, rec.JOB, now_s=clock.now_s)
        assert state["last_step"] == 2 and state["num_ranks_reporting"] == 2
        assert [(r["rank"], r["state"], round(r["silent_s"])) for r in state["ranks"]] == [
            (0, "compute", 5),
            (1, "in_collective", 60),
        ]
        coll = queries.collectives(conn, rec.JOB, step_start=0, step_end=10, by_rank=False)
        assert coll == [
            {
                "group": "dp",
                "op": "all_reduce",
                "count": 6,
                "bytes": 600,
                "total_device_s": 0.0,
                "max_device_s": 0.0,
                "total_wait_s": pytest.approx(0.2),
                "num_steps": 1,
            }
        ]
        (found,) = queries.findings(conn, job_id=rec.JOB, state=None, kind=None, limit=10)
        assert found["state"] == "acknowledged"
        (action,) = queries.actions(conn, job_id=rec.JOB, limit=10)
        assert (action["state"], action["result"]) == ("succeeded", "ok")
        (ckpt,) = queries.checkpoints(conn, rec.JOB, limit=10)
        assert ckpt["verified"] is True and ckpt["location"] == "/ckpt/2"
        (diag,) = queries.diag_results(conn, node="n2", limit=10)
        assert (diag["verdict"], diag["baseline"]) == ("suspect", 500.0)


def test_steps_and_per_rank_aggregates(store: Store) -> None:
    slow = [rec.step(3, s, seconds=0.9, wait=0.0) for s in range(10)]
    store.ingest(rec.batch([*rec.steps(3, 10), *slow], "b"))
    with store.read() as conn:
        rows = queries.steps(conn, rec.JOB, step_start=2, step_end=3, rank=None, limit=100)
        assert [(r["step"], r["rank"]) for r in rows] == [(s, r) for s in (2, 3) for r in range(4)]
        per = {r["rank"]: r for r in queries.per_rank(conn, rec.JOB, step_start=0, step_end=9)}
    assert per[3]["mean_step_time_s"] == pytest.approx(0.9)
    assert per[3]["mean_compute_s"] == pytest.approx(0.9)
    assert per[0]["mean_compute_s"] == pytest.approx(0.4)
    assert per[0]["num_steps"] == 10 and per[0]["tokens"] == 10_000


def test_heatmap_cells_missing_ranks_and_reruns(store: Store) -> None:
    store.ingest(
        rec.batch([rec.step(r, s, seconds=0.5 + r / 10) for s in range(4) for r in (0, 1, 3)], "b1")
    )
    # After a restart, step 2 re-runs on rank 1 and takes longer: the new attempt replaces the old.
    store.ingest(rec.batch([rec.step(1, 2, seconds=2.0, wait=1.5)], "b2"))
    with store.read() as conn:
        h = heatmap.heatmap(
            conn,
            rec.JOB,
            metric=heatmap.HeatmapMetric.STEP_TIME,
            step_start=0,
            step_end=3,
            max_steps=100,
        )
        wait = heatmap.heatmap(
            conn,
            rec.JOB,
            metric=heatmap.HeatmapMetric.COMM_WAIT,
            step_start=2,
            step_end=2,
            max_steps=100,
        )
        (row,) = queries.steps(conn, rec.JOB, step_start=2, step_end=2, rank=1, limit=10)
    # Rank 2 never reported: it is not a column.
    assert h["ranks"] == [0, 1, 3] and h["steps"] == [0, 1, 2, 3] and h["stride"] == 1
    assert h["values"][0] == pytest.approx([0.5, 0.6, 0.8])
    assert h["values"][2][1] == pytest.approx(2.0) and wait["values"][0][1] == pytest.approx(1.5)
    assert row["end_s"] - row["start_s"] == pytest.approx(2.0)


def test_heatmap_downsamples_long_ranges(store: Store) -> None:
    store.ingest(
        rec.batch([rec.step(r, s, seconds=float(s)) for s in range(10) for r in range(2)], "b")
    )
    with store.read() as conn:
        h = heatmap.heatmap(
            conn,
            rec.JOB,
            metric=heatmap.HeatmapMetric.STEP_TIME,
            step_start=0,
            step_end=9,
            max_steps=5,
        )
    assert h["stride"] == 2 and h["steps"] == [0, 2, 4, 6, 8]
    assert h["values"] == [[0.5, 0.5], [2.5, 2.5], [4.5, 4.5], [6.5, 6.5], [8.5, 8.5]]


def test_retention_expires_raw_data_and_rollups_keep_long_ranges(
    store: Store, clock: FakeClock
) -> None:
    policy = retention.RetentionPolicy(raw_retention_s=3600.0, rollup_bucket_s=60.0)
    old = clock.now_s
    store.ingest(
        rec.batch(
            [rec.sample("n1", 600.0 + i, float(i)) for i in range(120)]
            + [schema.Heartbeat(job_id=rec.JOB, rank=0, time_s=old)]
            + rec.steps(2, 2),
            "old",
        )
    )
    clock.now_s = old + 600.0
    store.ingest(rec.batch([rec.sample("n1", 900.0, 1000.0)], "recent"))
    clock.now_s = old + 3700.0  # the first batch is past retention, the second is not
    report = retention.run_once(store, policy, now_s=clock.now_s)
    assert report.rolled_up == 121
    assert report.expired == {"samples": 120, "heartbeats": 1, "coll_events": 0}
    assert _count(store, tables.samples) == 1 and _count(store, tables.step_records) == 4
    assert retention.run_once(store, policy, now_s=clock.now_s).rolled_up == 0  # no double counting
    with store.read() as conn:
        wide = samples.series(
            conn,
            samples.SampleQuery(metric="gpu_util", start_s=0, end_s=1200, points=10),
            rollup_bucket_s=60.0,
        )
        narrow = samples.series(
            conn,
            samples.SampleQuery(metric="gpu_util", start_s=600, end_s=720, points=120),
            rollup_bucket_s=60.0,
        )
    assert wide["source"] == "rollup"
    (series,) = wide["series"]
    by_time = {p["time_s"]: p for p in series["points"]}
    assert by_time[600.0]["count"] == 120 and by_time[600.0]["mean"] == pytest.approx(59.5)
    assert by_time[840.0]["max"] == 1000.0
    assert narrow["source"] == "raw" and narrow["series"] == []  # raw samples of that range expired


def test_samples_are_downsampled_to_the_requested_points(store: Store) -> None:
    store.ingest(
        rec.batch(
            [rec.sample("n1", float(t), float(t)) for t in range(100)]
            + [rec.sample("n2", float(t), 1.0) for t in range(100)],
            "s",
        )
    )
    with store.read() as conn:
        out = samples.series(
            conn,
            samples.SampleQuery(metric="gpu_util", start_s=0, end_s=100, points=4, node="n1"),
            rollup_bucket_s=60.0,
        )
    (series,) = out["series"]
    assert [p["count"] for p in series["points"]] == [25, 25, 25, 25]
    assert [p["mean"] for p in series["points"]] == [12.0, 37.0, 62.0, 87.0]
    assert series["points"][1]["min"] == 25.0 and series["points"][1]["max"] == 49.0


def test_concurrent_batches_on_the_same_steps_keep_every_cell(store: Store) -> None:
    """Eight writers, each a different rank of the same steps, overlap in time."""
    errors: list[BaseException] = []

    def send(rank: int) -> None:
        try:
            for s in range(0, 20, 5):
                store.ingest(
                    rec.batch(
                        [rec.step(rank, x, seconds=1 + rank) for x in range(s, s + 5)],
                        f"r{rank}-{s}",
                    )
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    with store.read() as conn:
        h = heatmap.heatmap(
            conn,
            rec.JOB,
            metric=heatmap.HeatmapMetric.STEP_TIME,
            step_start=0,
            step_end=19,
            max_steps=100,
        )
    assert h["values"] == [[1.0 + r for r in range(8)] for _ in range(20)]


def test_store_size_is_reported(store: Store) -> None:
    store.ingest(rec.batch(rec.steps(8, 8), "b"))
    assert store.size_bytes() > 10_000


def test_a_key_repeated_within_one_batch_keeps_the_last_record(store: Store) -> None:
    store.ingest(rec.batch([rec.step(0, 0), rec.step(0, 0, seconds=3.0), rec.step(1, 0)], "dup"))
    with store.read() as conn:
        rows = queries.steps(conn, rec.JOB, step_start=0, step_end=0, rank=None, limit=10)
        h = heatmap.heatmap(
            conn,
            rec.JOB,
            metric=heatmap.HeatmapMetric.STEP_TIME,
            step_start=0,
            step_end=0,
            max_steps=1,
        )
    assert [(r["rank"], r["end_s"] - r["start_s"]) for r in rows] == [(0, 3.0), (1, 0.5)]
    assert h["values"] == [[3.0, 0.5]]


def test_bulk_rows_cover_exactly_their_tables_columns() -> None:
    """Bulk rows are wire-field tuples: a wire field without a column needs a migration."""
    for name, columns in writes.BULK_TABLES.items():
        table_columns = {c.name for c in tables.metadata.tables[name].columns} - {"id"}
        assert sorted(columns) == sorted(table_columns), name
