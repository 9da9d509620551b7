"""Shipping to a collector: outage for a whole run, spool bound, replay, auth, retries, and how
long shutdown may wait for a collector that accepts connections but never answers.

Talks real HTTP to `receiver.Receiver` (the ingest contract) on loopback; the SDK session is the
real one, in this process, with a tiny model.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import vigil.agent
from tests.agent import conftest, receiver
from vigil import codec, delivery, outbox, schema, spool
from vigil.agent import config, progress

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
    # Opened before the clean shutdown removes the page: the mapping still shows its last word.
    reader = progress.PageReader(session.page.path)
    try:
        durations = _train(STEPS)
    finally:
        vigil.agent.shutdown()
    assert not session.page.path.exists()
    # Training completed and was never held up by the unreachable collector.
    assert len(durations) == STEPS
    assert sorted(durations)[STEPS // 2] < 0.05
    left = spool.Spool(spool_dir, max_bytes=bound)  # shutdown released the owner lock
    assert 0 < left.size_bytes() <= bound
    assert session.shipper.spool.dropped_records > 0
    assert session.shipper.stats.ship_errors > 0
    assert reader.snapshot().health.dropped_records == session.shipper.spool.dropped_records
    reader.close()
    waiting = sum(b.num_records for b in left.pending())
    left.close()

    collector = receiver.Receiver(port)
    try:
        replayer = outbox.Outbox(
            config.ShipperConfig(
                collector_url=collector.url, spool_dir=spool_dir, spool_max_bytes=bound
            )
        )
        assert replayer.replay()
        assert replayer.replay()  # nothing left: a second replay sends nothing
        assert replayer.spool.pending() == [] and replayer.spool.size_bytes() == 0
        replayer.close()
    finally:
        collector.stop()
    # Everything that stayed within the bound arrived, once, oldest first.
    assert len(collector.records) == waiting
    assert len(set(collector.batch_ids)) == len(collector.batch_ids) == collector.requests
    assert list(spool_dir.glob("*.vgl")) == []
    steps = [r.step for r in collector.records if isinstance(r, schema.StepRecord)]
    assert steps == list(range(STEPS - len(steps), STEPS))  # the newest, contiguous, in order
    # Within a batch, step records (the columnar block) come after the other records.
    beats = [r for r in collector.records if isinstance(r, schema.Heartbeat)]
    assert beats and beats[-1].state is schema.RankState.FINISHED


def _shipper(tmp_path: Path, url: str, **options: object) -> outbox.Outbox:
    cfg = config.ShipperConfig(collector_url=url, spool_dir=tmp_path / "spool", **options)  # type: ignore[arg-type]
    return outbox.Outbox(cfg, sleep=lambda _s: None)


def _beat(i: int) -> schema.Heartbeat:
    return schema.Heartbeat(job_id="j", rank=0, time_s=float(i), last_step=i)


def test_a_refused_token_keeps_batches_until_a_sender_with_the_right_one(tmp_path: Path) -> None:
    collector = receiver.Receiver(token="secret")
    try:
        shipper = _shipper(tmp_path, collector.url)  # no token: the collector answers 401
        shipper.write([_beat(1), _beat(2)])
        shipper.write([_beat(3)])
        # Not the batches' fault: one try per round, nothing quarantined, nothing lost.
        assert collector.requests == 2 and collector.records == []
        assert len(shipper.spool.pending()) == 2 and shipper.stats.quarantined_batches == 0
        shipper.close()
        authed = _shipper(tmp_path, collector.url, token="secret")
        authed.write([_beat(4)])
        assert [r.last_step for r in collector.records] == [1, 2, 3, 4]  # type: ignore[union-attr]
        authed.close()
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
        shipper = outbox.Outbox(cfg, sleep=delays.append)
        shipper.write([_beat(1)])  # 503, 503, then 200 on the third attempt
        assert delays == [0.5, 0.8] and len(collector.records) == 1  # no wait before the first
        collector.fail_first = collector.requests + 3  # down for the next three attempts
        shipper.write([_beat(2)])
        assert shipper.stats.ship_errors == 5 and len(shipper.spool.pending()) == 1
        shipper.write([_beat(3)])  # the spooled batch goes first, then this one
        assert [r.last_step for r in collector.records] == [1, 2, 3]  # type: ignore[union-attr]
    finally:
        collector.stop()


def test_backoff_schedule_doubles_up_to_the_cap() -> None:
    assert list(delivery.backoff_delays(0.2, 1.0, 5)) == [0.0, 0.2, 0.4, 0.8, 1.0]


@pytest.fixture
def silent_collector() -> Iterator[str]:
    """A collector that accepts TCP connections and never answers (the kernel's backlog
    accepts them; nobody reads)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_shutdown_waits_for_a_silent_collector_at_most_its_total_timeout(
    tmp_path: Path, silent_collector: str
) -> None:
    spool_dir = tmp_path / "spool"
    session = vigil.agent.init(
        job="silent",
        collector=silent_collector,
        progress_dir=tmp_path / "pages",
        spool_dir=spool_dir,
        flush_interval_s=0.05,
        shutdown_timeout_s=1.0,  # each POST may wait 5 s (timeout_s): the total is what counts
        measure_cpu_peak=False,
    )
    assert session is not None
    _train(20)
    time.sleep(0.2)  # the flusher is now inside a POST that will never be answered
    start = time.monotonic()
    vigil.agent.shutdown()
    took = time.monotonic() - start
    assert took < 2.0, f"shutdown took {took:.1f} s with a 1 s budget"
    # The last word did not go: it waits in the spool for the node agent. (The flusher thread
    # is still in its unanswered POST; when that times out it spools its batch and lets go.)
    left = conftest.poll_until(
        lambda: _try_open(spool_dir), timeout_s=10, what="the flusher to let go of the spool"
    )
    records = [r for b in left.pending() for r in codec.decode_batch(b.path.read_bytes()).records]
    left.close()
    beats = [r for r in records if isinstance(r, schema.Heartbeat)]
    assert beats and beats[-1].state is schema.RankState.FINISHED


def _try_open(directory: Path) -> spool.Spool | None:
    try:
        return spool.Spool(directory, max_bytes=config.DEFAULT_SPOOL_MAX_BYTES)
    except spool.SpoolBusyError:
        return None
