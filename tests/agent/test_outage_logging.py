"""An unreachable collector is said out loud: one WARNING naming the URL and the error, then at
most one a minute with what is pending, and INFO when delivery resumes. Also the pure rules
that decide what an answer means.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.agent import conftest, receiver
from vigil import delivery, outbox, schema
from vigil.agent import config, daemon

Outcome = delivery.Outcome


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_unreachable_collector_warns_once_then_once_a_minute_then_says_it_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="vigil")
    port = conftest.free_port()
    url = f"http://127.0.0.1:{port}"
    clock = _Clock()
    cfg = config.ShipperConfig(collector_url=url, spool_dir=tmp_path / "spool")
    shipper = outbox.Outbox(cfg, sleep=lambda _s: None, clock=clock)
    beat = schema.Heartbeat(job_id="j", rank=0, time_s=1.0, last_step=1)
    for _ in range(30):  # 30 flushes in 30 s
        shipper.write([beat])
        clock.now += 1.0
    first = _warnings(caplog)
    assert len(first) == 1
    assert url in first[0] and "Connection refused" in first[0]
    for _ in range(40):  # past the minute
        shipper.write([beat])
        clock.now += 1.0
    again = _warnings(caplog)[1:]
    assert len(again) == 1 and url in again[0] and "61 batches" in again[0]
    collector = receiver.Receiver(port)
    try:
        caplog.clear()
        shipper.write([beat])
        resumed = [r for r in caplog.records if "resumed" in r.getMessage()]
        assert [r.levelno for r in resumed] == [logging.INFO] and url in resumed[0].getMessage()
        assert len(collector.records) == 71 and not _warnings(caplog)
        shipper.close()
    finally:
        collector.stop()


def test_an_agent_pointed_nowhere_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vigil")
    url = f"http://127.0.0.1:{conftest.free_port()}"
    cfg = config.AgentConfig(
        node="n1", progress_dir=tmp_path / "pages", collector=url, use_nvml=False
    )
    agent = daemon.Agent(cfg, gpus=None)
    agent.flusher.start()
    agent.sample()  # queues host samples
    agent.flusher.flush_soon()
    conftest.poll_until(lambda: _warnings(caplog), timeout_s=10, what="a warning")
    agent.stop()
    assert any(url in w and "Connection refused" in w for w in _warnings(caplog))


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.COMMITTED),
        (400, Outcome.REJECTED),
        (413, Outcome.REJECTED),
        (422, Outcome.REJECTED),
        (401, Outcome.UNAVAILABLE),
        (403, Outcome.UNAVAILABLE),
        (429, Outcome.UNAVAILABLE),
        (500, Outcome.REFUSED),
        (503, Outcome.REFUSED),
    ],
)
def test_what_an_answer_means(status: int, outcome: delivery.Outcome) -> None:
    assert delivery.classify(status) is outcome


def test_poison_needs_refusals_and_a_collector_that_commits_others() -> None:
    def poison(refusals: int, commits_now: int) -> bool:
        return delivery.is_poison(
            refusals=refusals, commits_at_first_refusal=3, commits_now=commits_now, max_refusals=5
        )

    assert poison(5, 4)
    assert not poison(5, 3)  # 5xx to everything: an outage, not a bad batch
    assert not poison(4, 9)
