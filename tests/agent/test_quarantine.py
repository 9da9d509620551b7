"""A batch the collector keeps refusing is quarantined and the batches behind it flow; an outage
(5xx to everything, nobody listening, no answer) quarantines nothing.

Real HTTP to `receiver.Receiver` on loopback; `answer` makes it fail on chosen batches.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.agent import conftest, receiver
from vigil import codec, outbox, schema, spool
from vigil.agent import config, exporter, progress

pytestmark = pytest.mark.integration


def _beat(i: int) -> schema.Heartbeat:
    return schema.Heartbeat(job_id="j", rank=0, time_s=float(i), last_step=i)


def _steps(collector: receiver.Receiver) -> list[int]:
    return [r.last_step for r in collector.records if isinstance(r, schema.Heartbeat)]


def _has_step(step: int, status: int) -> Callable[[schema.Batch], int | None]:
    def answer(batch: schema.Batch) -> int | None:
        steps = [r.last_step for r in batch.records if isinstance(r, schema.Heartbeat)]
        return status if step in steps else None

    return answer


def _shipper(tmp_path: Path, url: str, **options: object) -> outbox.Outbox:
    cfg = config.ShipperConfig(collector_url=url, spool_dir=tmp_path / "spool", **options)  # type: ignore[arg-type]
    return outbox.Outbox(cfg, sleep=lambda _s: None)


def _quarantined_steps(shipper: outbox.Outbox) -> list[int]:
    return [
        r.last_step  # type: ignore[union-attr]
        for path in shipper.spool.quarantined()
        for r in codec.decode_batch(path.read_bytes()).records
    ]


def test_a_batch_that_always_gets_a_5xx_is_quarantined_and_the_rest_flows(tmp_path: Path) -> None:
    collector = receiver.Receiver(answer=_has_step(2, 500))
    try:
        shipper = _shipper(tmp_path, collector.url, max_attempts=2, max_server_errors=4)
        for i in range(1, 7):
            shipper.write([_beat(i)])
        # Nothing waited behind the poison batch: every other batch arrived at its own flush.
        assert _steps(collector) == [1, 3, 4, 5, 6]
        # 2 answers a round; quarantined in the first round in which it had 4 and the collector
        # had committed another batch since it first refused this one (its third).
        assert shipper.stats.quarantined_batches == 1 and shipper.spool.pending() == []
        assert _quarantined_steps(shipper) == [2]
        assert sum(1 for _, status in collector.answered if status == 500) == 6
        shipper.write([_beat(7)])
        assert _steps(collector)[-1] == 7 and len(collector.answered) == 6 + 6  # never again
        shipper.close()
    finally:
        collector.stop()


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_batch_retrying_cannot_help_is_quarantined_at_once(tmp_path: Path, status: int) -> None:
    collector = receiver.Receiver(answer=_has_step(1, status))
    try:
        shipper = _shipper(tmp_path, collector.url)
        shipper.write([_beat(1)])
        shipper.write([_beat(2)])
        assert collector.requests == 2 and _steps(collector) == [2]
        assert shipper.stats.quarantined_batches == 1 and _quarantined_steps(shipper) == [1]
        assert shipper.stats.rejected_batches == 1
        shipper.close()
    finally:
        collector.stop()


def test_a_collector_failing_on_everything_quarantines_nothing(tmp_path: Path) -> None:
    collector = receiver.Receiver(fail_first=10**9)  # 503 to every request
    try:
        shipper = _shipper(tmp_path, collector.url, max_attempts=3, max_server_errors=2)
        for i in range(6):
            shipper.write([_beat(i)])
        assert shipper.stats.quarantined_batches == 0 and len(shipper.spool.pending()) == 6
        collector.fail_first = 0  # it recovers: everything arrives, in order
        shipper.write([_beat(6)])
        assert _steps(collector) == list(range(7)) and shipper.spool.pending() == []
        shipper.close()
    finally:
        collector.stop()


def test_transient_failures_never_quarantine(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        shipper = _shipper(tmp_path, url, timeout_s=0.05, max_attempts=2, max_server_errors=1)
        for i in range(3):
            shipper.write([_beat(i)])
        assert shipper.stats.quarantined_batches == 0 and len(shipper.spool.pending()) == 3
        shipper.close()
    refused = _shipper(tmp_path / "b", f"http://127.0.0.1:{conftest.free_port()}")
    for i in range(3):
        refused.write([_beat(i)])
    assert refused.stats.quarantined_batches == 0 and len(refused.spool.pending()) == 3
    assert not (refused.spool.directory / spool.QUARANTINE_DIR).exists()
    refused.close()


def test_quarantines_are_counted_on_the_page_and_in_metrics(tmp_path: Path) -> None:
    path = progress.page_path(tmp_path, "j", 0, "run-1")
    page = progress.PageWriter(
        path, job="j", node="n", rank=0, world_size=1, local_rank=0, capacity=16
    )
    page.health(progress.Health(quarantined_batches=2))
    reader = progress.PageReader(path)
    snap = reader.snapshot()
    assert snap.health.quarantined_batches == 2
    registry = CollectorRegistry()
    view = exporter.AgentView(
        node="n", ranks=[exporter.RankView(snap, 0.0, False)], quarantined_batches=3
    )
    registry.register(exporter.AgentCollector(lambda: view))
    text = generate_latest(registry).decode()
    assert "vigil_agent_quarantined_batches_total 3.0" in text
    assert 'vigil_sdk_quarantined_batches_total{job_id="j",node="n",rank="0"} 2.0' in text
    reader.close()
    page.close()
