"""The agent's control poller against a scripted collector: one request per page at a time, acks
reported a round after the SDK's, and a collector that is away or answers nonsense costs nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from vigil import sender
from vigil.agent import control_poll, progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Collector:
    """Scripted answers to the poller's two calls; records the acks it got."""

    def __init__(self) -> None:
        self.pending: list[object] = []
        self.acks: list[dict[str, object]] = []
        self.down = False
        self.ack_status = 200

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("refused", request=request)
        if request.method == "GET":
            assert request.url.params["node"] == "n1"
            return httpx.Response(200, json=self.pending)
        self.acks.append({"path": request.url.path, **json.loads(request.content)})
        return httpx.Response(self.ack_status, json={})


def _setup(
    tmp_path: Path,
) -> tuple[control_poll.ControlPoller, Collector, Clock, progress.PageWriter]:
    writer = progress.PageWriter(
        progress.page_path(tmp_path, "job", 3, "run-1"),
        job="job", node="n1", rank=3, world_size=8, local_rank=1, capacity=16,
    )  # fmt: skip
    reader = progress.PageReader(writer.path)
    fake, clock = Collector(), Clock()
    poller = control_poll.ControlPoller(
        cfg=sender.SenderConfig(collector_url="http://c:8470"),
        node="n1",
        pages=lambda: [("job", 3, reader)],
        client=httpx.Client(transport=httpx.MockTransport(fake.handle)),
        clock=clock,
        give_up_s=10.0,
    )
    return poller, fake, clock, writer


def _round(poller: control_poll.ControlPoller, clock: Clock) -> None:
    clock.now += poller.interval_s
    poller.tick()


def test_requests_reach_the_page_one_at_a_time_and_acks_follow_the_sdk(tmp_path: Path) -> None:
    poller, fake, clock, writer = _setup(tmp_path)
    fake.pending = [
        {"id": "a", "job_id": "job", "kind": "checkpoint", "ranks": [3], "created_s": 1.0},
        {"id": "b", "job_id": "job", "kind": "dump_stacks", "ranks": [3], "created_s": 2.0},
        {"id": "c", "job_id": "other", "kind": "checkpoint", "ranks": [3], "created_s": 3.0},
    ]
    _round(poller, clock)
    seq, kind = writer.control()
    assert (seq, kind) == (1, "checkpoint")  # "b" waits: the page holds one request
    _round(poller, clock)
    assert writer.control() == (1, "checkpoint") and fake.acks == []
    writer.ack(seq)  # the SDK took it
    _round(poller, clock)  # seen; reported next round
    assert fake.acks == []
    _round(poller, clock)
    assert fake.acks == [
        {"path": "/api/v1/control/a/ack", "node": "n1", "ranks": [3], "details": {}}
    ]
    fake.pending = fake.pending[1:]
    _round(poller, clock)
    assert writer.control() == (2, "dump_stacks")
    assert poller.delivered_requests == 2 and poller.acked_requests == 1


def test_a_collector_away_or_talking_nonsense_costs_nothing(tmp_path: Path) -> None:
    poller, fake, clock, writer = _setup(tmp_path)
    fake.down = True
    _round(poller, clock)
    fake.down = False
    fake.pending = [
        {"id": 5},
        "x",
        {"id": "a", "job_id": "job", "kind": "checkpoint", "ranks": ["3"]},
    ]
    _round(poller, clock)
    assert writer.control() == (0, "")
    fake.pending = {"not": "a list"}  # type: ignore[assignment]
    _round(poller, clock)
    assert writer.control() == (0, "")


def test_an_unanswered_page_is_given_up_and_a_lost_ack_is_sent_again(tmp_path: Path) -> None:
    poller, fake, clock, writer = _setup(tmp_path)
    fake.pending = [{"id": "a", "job_id": "job", "kind": "checkpoint", "ranks": [3]}]
    _round(poller, clock)
    clock.now += 11.0  # the rank never acknowledges
    _round(poller, clock)
    fake.pending = [{"id": "b", "job_id": "job", "kind": "checkpoint", "ranks": [3]}]
    _round(poller, clock)
    assert writer.control() == (2, "checkpoint")  # the page is free for the next request
    writer.ack(2)
    _round(poller, clock)
    fake.down = True
    _round(poller, clock)  # the ack cannot go: kept
    fake.down = False
    _round(poller, clock)
    assert [a["path"] for a in fake.acks] == ["/api/v1/control/b/ack"]


def test_an_outage_is_logged_once_until_the_collector_answers_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    poller, fake, clock, _writer = _setup(tmp_path)
    fake.down = True
    with caplog.at_level(logging.DEBUG, logger=control_poll.__name__):
        for _ in range(5):
            _round(poller, clock)
        fake.down = False
        _round(poller, clock)
    levels = [r.levelno for r in caplog.records]
    assert levels.count(logging.WARNING) == 1 and levels.count(logging.DEBUG) == 4
    assert "answers again" in caplog.records[-1].getMessage()
