"""The collector's analyzer runner hands a `MergingAnalyzer` the batches queued at each wake as
one call: on recorded real jobs (the SDK's JSONL of 4-rank gloo jobs, shipped the way senders
ship them: each rank its own batch of a few steps) the findings are those of one call per batch;
merges respect the analyzer's step span and the record budget; ticks are not starved; batches
whose step records came as records, not columns, keep them.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from tests.analyzer import recorded
from vigil import columns, schema
from vigil.analyzer import StreamingAnalyzer
from vigil.collector import analyzer_runner
from vigil.collector.analyzer_runner import AnalyzerRunner, MergingAnalyzer

Batch = tuple[list[schema.Record], columns.StepColumns | None]


def _rank_batches(folder: Path, steps_per_batch: int, seed: int) -> list[Batch]:
    """Each rank's records in its own batches of `steps_per_batch` steps (as a sender flushes
    them: step records as columns, the rest as records, in the order the SDK wrote them), the
    ranks' n-th batches arriving in a shuffled order before any (n+1)-th."""
    per_rank: list[list[list[schema.Record]]] = []
    for path in sorted(folder.glob("*.jsonl")):
        chunks: list[list[schema.Record]] = [[]]
        for r in recorded.records_of(path):
            chunks[-1].append(r)
            if (
                type(r) is schema.StepRecord
                and sum(type(x) is schema.StepRecord for x in chunks[-1]) == steps_per_batch
            ):
                chunks.append([])
        per_rank.append([c for c in chunks if c])
    rng = random.Random(seed)
    out: list[Batch] = []
    for n in range(max(map(len, per_rank))):
        round_ = [chunks[n] for chunks in per_rank if n < len(chunks)]
        rng.shuffle(round_)
        for chunk in round_:
            steps = [r for r in chunk if type(r) is schema.StepRecord]
            rest = [r for r in chunk if type(r) is not schema.StepRecord]
            out.append((rest, columns.from_records(steps) if steps else None))
    return out


class _Gated:
    """A StreamingAnalyzer whose first call waits for `gate`: the runner's queue fills meanwhile."""

    def __init__(self, inner: StreamingAnalyzer) -> None:
        self.inner = inner
        self.merge_steps = inner.merge_steps
        self.gate = threading.Event()
        self.sizes: list[int] = []

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        self.gate.wait(30.0)
        self.sizes.append(len(records) + (0 if steps is None else len(steps)))
        return self.inner.observe(records, steps)


def _final(found: Sequence[schema.Finding]) -> dict[str, tuple[object, ...]]:
    """Each finding's last state, by id (the store upserts by id)."""
    last = {f.finding_id: f for f in found}
    return {i: (f.kind, tuple(f.subjects.ranks), f.state, f.step_start) for i, f in last.items()}


CASES = [
    "jsonl_pipeline/slow-stage",
    "jsonl_pipeline/slow-forward",
    "jsonl_pipeline/clean-jitter",
    "jsonl_cuda/ddp-optimizer-2x",
    "jsonl_cuda/plain-clean",
    "jsonl_tbf_link/fsdp_tp-link",
]


@pytest.mark.parametrize("case", CASES)
def test_merged_batches_give_the_findings_of_one_call_per_batch(case: str) -> None:
    batches = _rank_batches(recorded.DATA / case, steps_per_batch=4, seed=len(case))
    alone = StreamingAnalyzer()
    one_by_one = [f for records, steps in batches for f in alone.observe(records, steps)]

    analyzer = _Gated(StreamingAnalyzer())
    assert isinstance(analyzer, MergingAnalyzer)
    merged: list[schema.Finding] = []
    runner = AnalyzerRunner(analyzer, store_findings=merged.extend, max_pending=10_000)
    futures = [runner.submit(records, steps) for records, steps in batches]
    analyzer.gate.set()
    for future in futures:
        assert future is not None
        future.result(timeout=60)
    runner.close()
    assert runner.pending == 0
    # Merged for real: far fewer calls than batches, each within the analyzer's step span.
    assert runner.calls * 4 < len(batches)
    assert _final(merged) == _final(one_by_one)
    if "clean" not in case:
        assert any(f.state is schema.FindingState.OPEN for f in merged)  # the fault was found


def _step(rank: int, step: int, job: str = "j") -> schema.StepRecord:
    return schema.StepRecord(
        job_id=job, rank=rank, step=step, start_s=100.0 + step, end_s=100.5 + step
    )


def _beat(rank: int, t: float) -> schema.Heartbeat:
    return schema.Heartbeat(job_id="j", rank=rank, time_s=t)


class _Recording:
    """Records each call's step numbers and record count; the first call waits for `gate`."""

    def __init__(self, merge_steps: int) -> None:
        self.merge_steps = merge_steps
        self.gate = threading.Event()
        self.entered = threading.Event()  # the first call began (and waits for `gate`)
        self.calls: list[tuple[list[int], int]] = []
        self.ticks: list[tuple[float, int]] = []  # (now, calls made before it)

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        self.entered.set()
        self.gate.wait(30.0)
        numbers = [] if steps is None else steps.column("step").astype(int).tolist()
        self.calls.append((numbers, len(records)))
        return []

    def tick(self, now_s: float) -> Sequence[schema.Finding]:
        self.ticks.append((now_s, len(self.calls)))
        return []


def test_merges_stay_within_the_analyzers_step_span_and_ticks_come_between() -> None:
    analyzer = _Recording(merge_steps=4)
    runner = AnalyzerRunner(analyzer, store_findings=lambda f: None, max_pending=100)
    first = runner.submit([], columns.from_records([_step(0, 0)]))
    assert analyzer.entered.wait(10.0)
    # Queued while the first call waits: steps 1..10 of two ranks, a tick in between.
    futures = [
        runner.submit([_beat(rank, 101.0 + step)], columns.from_records([_step(rank, step)]))
        for step in range(1, 11)
        for rank in (0, 1)
    ]
    tick = runner.tick(200.0)
    analyzer.gate.set()
    for future in [first, *futures, tick]:
        assert future is not None
        future.result(timeout=10)
    spans = [numbers for numbers, _ in analyzer.calls]
    assert spans[0] == [0]
    assert all(max(s) - min(s) + 1 <= 4 for s in spans)
    assert sorted(n for s in spans for n in s) == sorted([0, *[s for s in range(1, 11)] * 2])
    assert [n for s in spans for n in s] == [0, *[s for s in range(1, 11) for _ in (0, 1)]]
    assert sum(records for _, records in analyzer.calls) == 20  # every heartbeat, once
    assert len(spans) == 4  # 0 | 1-4 | 5-8 | 9-10
    # The tick queued behind the first merged call, not behind all of them.
    assert analyzer.ticks == [(200.0, 2)]
    runner.close()


def test_a_merge_keeps_step_records_that_came_as_records_and_respects_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    analyzer = _Recording(merge_steps=100)
    runner = AnalyzerRunner(analyzer, store_findings=lambda f: None, max_pending=100)
    monkeypatch.setattr(analyzer_runner, "MAX_MERGE_RECORDS", 6)
    runner.submit([], None)
    assert analyzer.entered.wait(10.0)
    # A batch without columns (its step records as records), then two with columns.
    runner.submit([_step(2, 5), _beat(2, 105.0)], None)
    runner.submit([_beat(3, 105.0)], columns.from_records([_step(3, 5)]))
    runner.submit([_beat(4, 105.0)], columns.from_records([_step(4, 5), _step(4, 6)]))
    last = runner.submit([], columns.from_records([_step(5, 5)]))
    analyzer.gate.set()
    assert last is not None
    last.result(timeout=10)
    # 2 + 2 records fit in 6; the next (3) does not; the last (1) joins it.
    assert [numbers for numbers, _ in analyzer.calls] == [[], [5, 5], [5, 6, 5]]
    runner.close()


def test_merge_concatenates_records_and_step_columns_in_commit_order() -> None:
    a = ([_beat(0, 1.0)], columns.from_records([_step(0, 1), _step(0, 2)]))
    b: Batch = ([_step(1, 1), _beat(1, 1.0)], None)
    c: Batch = ([_beat(2, 1.0)], None)
    records, steps = analyzer_runner.merge([a, b, c])
    kinds = [type(r).__name__ for r in records]
    assert kinds == ["Heartbeat", "StepRecord", "Heartbeat", "Heartbeat"]
    assert steps is not None
    assert steps.column("rank").tolist() == [0, 0, 1]
    assert steps.loss is None  # columns built from records carry no loss
    assert analyzer_runner.merge([c, c])[1] is None
    block = columns.to_block([_step(0, 1)])
    assert block is not None
    both = columns.concat([columns.from_block(block)] * 2)
    assert both.loss is not None and np.isnan(both.loss).all() and len(both) == 2


def test_widen_refuses_a_span_past_the_limit_per_job() -> None:
    assert analyzer_runner.widen({"a": (3, 5)}, {"a": (6, 6), "b": (100, 200)}, 101) == {
        "a": (3, 6),
        "b": (100, 200),
    }
    assert analyzer_runner.widen({"a": (3, 5)}, {"a": (9, 9)}, 6) is None
    assert analyzer_runner.widen({"a": (3, 5)}, {"b": (9, 9)}, 3) == {"a": (3, 5), "b": (9, 9)}


def test_close_cancels_what_it_could_not_analyse() -> None:
    analyzer = _Recording(merge_steps=1)
    runner = AnalyzerRunner(analyzer, store_findings=lambda f: None, max_pending=100)
    futures = [runner.submit([], columns.from_records([_step(0, s)])) for s in range(3)]
    assert analyzer.entered.wait(10.0)
    runner.close(timeout_s=0.2)  # the first call still waits at the gate
    analyzer.gate.set()
    assert futures[-1] is not None and futures[-1].cancelled()
    assert runner.submit([], None) is None  # closed: nothing analyses it


def test_the_queue_is_bounded_by_records_as_well_as_batches() -> None:
    analyzer = _Recording(merge_steps=100)
    dropped: list[int] = []
    runner = AnalyzerRunner(
        analyzer,
        store_findings=lambda f: None,
        on_drop=lambda: dropped.append(1),
        max_pending=10,
        max_pending_records=3,
    )
    runner.submit([_beat(0, 1.0)] * 5, None)  # taken at once: the worker holds it, however large
    assert analyzer.entered.wait(10.0)
    two = [_beat(1, 1.0), _beat(2, 1.0)]
    assert runner.submit(two, None) is not None  # 2 queued records
    assert runner.submit(two, None) is None  # 4 would exceed 3: dropped, counted
    last = runner.submit([_beat(3, 1.0)], None)  # 3
    assert last is not None and dropped == [1]
    analyzer.gate.set()
    last.result(timeout=10)
    assert [records for _, records in analyzer.calls] == [5, 3]
    runner.close()
    with pytest.raises(ValueError, match="max_pending_records must be >= 1"):
        AnalyzerRunner(analyzer, store_findings=lambda f: None, max_pending_records=0)
