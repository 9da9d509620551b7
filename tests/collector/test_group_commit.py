"""Group commit on SQLite and a real PostgreSQL: batches that arrive while a transaction is being
written share the next one, each stored exactly once, and a batch the store refuses fails alone.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from sqlalchemy import func, select

from tests.collector import records as rec
from vigil import codec, schema
from vigil.collector import Store, heatmap, tables, validate
from vigil.collector.commits import GroupCommit
from vigil.collector.store import IngestResult, mergeable

pytestmark = pytest.mark.integration

Item = tuple[schema.Batch, validate.Checked]


def _framed(records: list[schema.Record], batch_id: str) -> Item:
    """As the collector decodes a sender's frame: step records come as a columnar block."""
    batch, steps = codec.decode_frame(codec.encode_batch(records, batch_id=batch_id))
    return batch, validate.prepare_batch(batch.records, steps)


def _as_records(records: list[schema.Record], batch_id: str) -> Item:
    """A v1 sender's batch: step records as records."""
    batch = rec.batch(records, batch_id)
    return batch, validate.prepare_batch(batch.records)


def _count(store: Store, table: object) -> int:
    with store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]


def _cells(store: Store, steps: int) -> list[list[float | None]]:
    """The step-time heatmap, steps x ranks (None: a rank that did not report the step)."""
    with store.read() as conn:
        h = heatmap.heatmap(
            conn,
            rec.JOB,
            metric=heatmap.HeatmapMetric.STEP_TIME,
            step_start=0,
            step_end=steps - 1,
            max_steps=100,
        )
    return [[None if math.isnan(v) else v for v in row] for row in h["values"]]


def test_ingest_many_stores_each_batch_once(store: Store) -> None:
    store.ingest(rec.batch([rec.step(5, 0)], "old"))
    a = _framed([rec.step(0, 0), rec.step(0, 1), rec.step(1, 0), rec.step(1, 1),
                 rec.sample("n1", 1.0, 1.0)], "a")  # fmt: skip
    b = _as_records([rec.step(2, 0, seconds=2.0), rec.step(2, 1, seconds=2.0)], "b")
    old = _framed([rec.step(5, 0)], "old")
    a_again = _framed([rec.step(0, 0)], "a")  # a retry of "a" while "a" is in the same group
    results = store.ingest_many([a, b, old, a_again])
    assert [(r.batch_id, r.duplicate) for r in results] == [
        ("a", False), ("b", False), ("old", True), ("a", True),
    ]  # fmt: skip
    assert results[0].counts == {"step": 4, "sample": 1} and results[1].counts == {"step": 2}
    assert [len(r.steps) if r.steps is not None else None for r in results] == [4, 2, None, None]
    assert results[0].accepted == 5 and results[3].accepted == 1
    assert _count(store, tables.step_records) == 1 + 6
    assert _count(store, tables.samples) == 1
    assert store.batch_seen("a") == 5 and store.batch_seen("b") == 2
    assert _cells(store, 2) == [[0.5, 0.5, 2.0, 0.5], [0.5, 0.5, 2.0, None]]


def test_a_batch_with_step_records_in_both_forms_is_written_alone(store: Store) -> None:
    batch, steps = codec.decode_frame(codec.encode_batch([rec.step(0, 0)], batch_id="mixed"))
    batch.records.append(rec.step(1, 0))
    mixed = (batch, validate.prepare_batch(batch.records, steps))
    assert not mergeable(mixed[1])
    with pytest.raises(ValueError, match="mixed"):
        store.ingest_many([mixed, _framed([rec.step(2, 0)], "plain")])
    commits = GroupCommit(store)
    results = _concurrently(commits, [mixed, _framed([rec.step(2, 0)], "plain")])
    assert [r.counts for r in results if isinstance(r, IngestResult)] == [{"step": 2}, {"step": 1}]
    assert commits.transactions == 2 and _count(store, tables.step_records) == 3


def _concurrently(commits: GroupCommit, items: list[Item]) -> list[IngestResult | BaseException]:
    """Each item ingested by a thread of its own, all queued while another transaction is being
    written (so they share the next)."""
    out: list[IngestResult | BaseException] = [RuntimeError("not run")] * len(items)

    def send(i: int) -> None:
        try:
            out[i] = commits.ingest(*items[i])
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(items))]
    with commits._writing:  # a transaction in progress
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(commits._queue) < len(items):
            assert time.monotonic() < deadline, "requests did not queue"
            time.sleep(0.01)
    for t in threads:
        t.join(timeout=60)
    return out


def test_concurrent_batches_share_one_transaction(store: Store) -> None:
    commits = GroupCommit(store)
    items = [
        _framed([rec.step(rank, s, seconds=1.0 + rank) for s in range(3)], f"r{rank}")
        for rank in range(8)
    ]
    results = _concurrently(commits, items)
    assert all(isinstance(r, IngestResult) and not r.duplicate for r in results)
    assert commits.transactions == 1
    assert _cells(store, 3) == [[1.0 + r for r in range(8)] for _ in range(3)]
    # A lone request is written at once, in its own transaction.
    assert not commits.ingest(*_framed([rec.step(0, 3)], "alone")).duplicate
    assert commits.transactions == 2


def test_a_batch_the_store_refuses_fails_alone(store: Store) -> None:
    commits = GroupCommit(store)
    bad = rec.step(1, 0)
    bad.step = 2**60  # past the 2**53 the store holds exactly: verified in the transaction
    items = [
        _framed([rec.step(0, 0)], "good-0"),
        _as_records([bad], "bad"),
        _framed([rec.step(2, 0)], "good-2"),
    ]
    results = _concurrently(commits, items)
    assert isinstance(results[1], codec.DecodeError) and "StepRecord.step" in str(results[1])
    assert isinstance(results[0], IngestResult) and isinstance(results[2], IngestResult)
    assert commits.transactions == 1 + 3  # the refused group, then each batch alone
    assert store.batch_seen("bad") is None and store.batch_seen("good-2") == 1
    assert _count(store, tables.step_records) == 2


def test_a_store_that_fails_fails_every_batch_of_the_group(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(items: object) -> list[IngestResult]:
        raise TimeoutError("no SQLite write slot")

    monkeypatch.setattr(store, "ingest_many", down)
    commits = GroupCommit(store)
    results = _concurrently(commits, [_framed([rec.step(r, 0)], f"b{r}") for r in range(3)])
    assert all(isinstance(r, TimeoutError) for r in results)
    assert _count(store, tables.step_records) == 0
