"""The streaming analyzer in a child process: same findings as in-process, ticks, restarts."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from vigil import codec, columns, schema
from vigil.analyzer import StreamingAnalyzer
from vigil.analyzer import simulator as sim
from vigil.collector.analyzer_process import AnalyzerProcessError, ProcessAnalyzer
from vigil.collector.hook import AnalyzerRunner, FrameAnalyzer

STRAGGLER = sim.Fault(kind=sim.FaultKind.STRAGGLER, ranks=(5,), factor=1.3, start_step=10)


@pytest.fixture
def child() -> Iterator[ProcessAnalyzer]:
    analyzer = ProcessAnalyzer(StreamingAnalyzer)
    yield analyzer
    analyzer.close()


def _batches() -> list[list[schema.Record]]:
    config = sim.ScenarioConfig(num_ranks=16, num_steps=40, faults=(STRAGGLER,), seed=3)
    return list(sim.simulate(config).records())


def test_frames_in_the_child_find_what_the_in_process_analyzer_finds(
    child: ProcessAnalyzer,
) -> None:
    assert isinstance(child, FrameAnalyzer)
    local = StreamingAnalyzer()
    expected: list[schema.Finding] = []
    got: list[schema.Finding] = []
    for batch in _batches():
        steps = columns.from_records([r for r in batch if isinstance(r, schema.StepRecord)])
        expected.extend(local.observe(batch, steps))
        got.extend(child.observe_frame(codec.encode_batch(batch)))
    assert [f.kind for f in got] == [f.kind for f in expected]
    assert any(f.kind == "straggler" and f.subjects.ranks == [5] for f in got)
    assert [f.finding_id for f in got] == [f.finding_id for f in expected]
    assert list(child.tick(time.time())) == list(local.tick(time.time()))


def test_a_killed_child_is_replaced_and_the_lost_call_is_an_error(child: ProcessAnalyzer) -> None:
    batch = _batches()[0]
    child.observe(batch)  # records, re-encoded for the child (the hook's generic path)
    first = child.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    with pytest.raises(AnalyzerProcessError, match="restarted"):
        child.observe_frame(codec.encode_batch(batch))
    assert child.pid not in (None, first)
    assert list(child.observe_frame(codec.encode_batch(batch))) == []  # works again


def test_runner_sends_frames_and_counts_child_errors(child: ProcessAnalyzer) -> None:
    stored: list[schema.Finding] = []
    errors: list[int] = []
    runner = AnalyzerRunner(child, store_findings=stored.extend, on_error=lambda: errors.append(1))
    for batch in _batches():
        runner.submit(batch, None, frame=codec.encode_batch(batch))
    runner.submit([], None, frame=b"not a frame").result(timeout=30)  # the child reports, lives
    assert runner.pending == 0
    assert any(f.kind == "straggler" for f in stored) and errors == [1]
    runner.close()
    assert child.pid is None  # closing the runner stops the child
