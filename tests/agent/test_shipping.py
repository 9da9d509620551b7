"""Shipping to a collector: outage for a whole run, spool bound, replay, rejection, retries.

Talks real HTTP to `receiver.Receiver` (the ingest contract) on loopback; the SDK session is the
real one, in this process, with a tiny model.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import vigil.agent
from tests.agent import conftest, receiver
from vigil import schema
from vigil.agent import config, progress, shipping

pytestmark = pytest.mark.integration
STEPS = 150


def _train(steps: int) -> list[float]:
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vigil.agent.watch(model, opt)
    durations = []
    for i in range(steps):
        start = time.perf_counter()
        with vigil.agent.step(i, tokens=4) as s:
            loss = model(torch.randn(4, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.set_loss(loss.item())
        durations.append(time.perf_counter() - start)
        time.sleep(0.002)  # lets the 20 ms flusher ship many small batches
    return durations


def test_collector_down_for_the_whole_run_then_replay(tmp_path: Path) -> None:
    port = conftest.free_port()  # nobody listens here until the "collector comes back"
    spool_dir, bound = tmp_path / "spool", 6_000
    session = vigil.agent.init(
        job="outage",
        collector=f"http://127.0.0.1:{port}",
        progress_dir=tmp_path / "pages",
        spool_dir=spool_dir,
        spool_max_bytes=bound,
        flush_interval_s=0.02,
        measure_cpu_peak=False,
    )
    assert session is not None and session.shipper is not None
    try:
        durations = _train(STEPS)
    finally:
        vigil.agent.shutdown()
    # Training completed and was never held up by the unreachable collector.
    assert len(durations) == STEPS
    assert sorted(durations)[STEPS // 2] < 0.05
    spool = shipping.Spool(spool_dir, max_bytes=bound)
    assert 0 < spool.size_bytes() <= bound
    assert session.shipper.spool.dropped_records > 0
    assert session.shipper.stats.ship_errors > 0
    reader = progress.PageReader(progress.page_path(tmp_path / "pages", "outage", 0))
    assert reader.snapshot().health.dropped_records == session.shipper.spool.dropped_records
    reader.close()
    waiting = sum(b.num_records for b in spool.pending())

    collector = receiver.Receiver(port)
    try:
        replayer = shipping.Shipper(
            config.ShipperConfig(
                collector_url=collector.url, spool_dir=spool_dir, spool_max_bytes=bound
            )
        )
        assert replayer.replay()
        assert replayer.replay()  # nothing left: a second replay sends nothing
        replayer.close()
    finally:
        collector.stop()
    # Everything that stayed within the bound arrived, once, oldest first.
    assert len(collector.records) == waiting
    assert len(set(collector.batch_ids)) == len(collector.batch_ids) == collector.requests
    assert spool.pending() == []
    steps = [r.step for r in collector.records if isinstance(r, schema.StepRecord)]
    assert steps == list(range(STEPS - len(steps), STEPS))  # the newest, contiguous, in order
    # Within a batch, step records (the columnar block) come after the other records.
    beats = [r for r in collector.records if isinstance(r, schema.Heartbeat)]
    assert beats and beats[-1].state is schema.RankState.FINISHED


def _shipper(tmp_path: Path, url: str, **options: object) -> shipping.Shipper:
    cfg = config.ShipperConfig(collector_url=url, spool_dir=tmp_path / "spool", **options)  # type: ignore[arg-type]
    return shipping.Shipper(cfg, sleep=lambda _s: None)


def _beat(i: int) -> schema.Heartbeat:
    return schema.Heartbeat(job_id="j", rank=0, time_s=float(i), last_step=i)


def test_rejected_batch_is_counted_and_never_retried(tmp_path: Path) -> None:
    collector = receiver.Receiver(token="secret")
    try:
        shipper = _shipper(tmp_path, collector.url)  # no token: the collector answers 401
        shipper.write([_beat(1), _beat(2)])
        shipper.write([_beat(3)])
        assert shipper.stats.rejected_batches == 2 and collector.requests == 2
        assert shipper.spool.pending() == [] and collector.records == []
        authed = _shipper(tmp_path, collector.url, token="secret")
        authed.write([_beat(4)])
        assert [r.last_step for r in collector.records] == [4]  # type: ignore[union-attr]
    finally:
        collector.stop()


def test_server_errors_are_retried_with_backoff_then_spooled(tmp_path: Path) -> None:
    collector = receiver.Receiver(fail_first=2)
    delays: list[float] = []
    try:
        cfg = config.ShipperConfig(
            collector_url=collector.url,
            spool_dir=tmp_path / "spool",
            max_attempts=3,
            backoff_initial_s=0.5,
            backoff_max_s=0.8,
        )
        shipper = shipping.Shipper(cfg, sleep=delays.append)
        shipper.write([_beat(1)])  # 503, 503, then 200 on the third attempt
        assert delays == [0.0, 0.5, 0.8] and len(collector.records) == 1
        collector.fail_first = collector.requests + 3  # down for the next three attempts
        shipper.write([_beat(2)])
        assert shipper.stats.ship_errors == 5 and len(shipper.spool.pending()) == 1
        shipper.write([_beat(3)])  # the spooled batch goes first, then this one
        assert [r.last_step for r in collector.records] == [1, 2, 3]  # type: ignore[union-attr]
    finally:
        collector.stop()


def test_backoff_schedule_doubles_up_to_the_cap() -> None:
    assert list(shipping.backoff_delays(0.2, 1.0, 5)) == [0.0, 0.2, 0.4, 0.8, 1.0]
