"""The node agent's relay between the SDK's own sender and a real `vigil collector`: frames of
concurrent senders go several per request, each sender gets its own frame's answer (a bad
frame is refused alone, a retry is a duplicate), a collector away is a 502 the sender retries,
and a collector without the frames path gets each frame alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent.conftest import free_port, poll_until
from tests.agent.receiver import Receiver
from tests.collector import records as rec
from tests.support import processes
from vigil import codec, sender
from vigil.agent import relay as relay_mod

pytestmark = pytest.mark.integration
Outcome = sender.Outcome


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("relay-collector")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = processes.start(
        [
            sys.executable,
            *("-m", "vigil", "collector", "--host", "127.0.0.1", "--port", str(port)),
            *("--store", f"sqlite:///{tmp / 'collector.sqlite3'}", "--no-analyzer"),
        ],
        tmp / "collector.log",
        {"VIGIL_DATA_DIR": str(tmp / "data")},
    )
    try:
        poll_until(lambda: _healthy(url) or None, timeout_s=60, what="the collector")
        yield url
    finally:
        processes.stop(proc)


@pytest.fixture
def node(collector: str) -> Iterator[relay_mod.RelayServer]:
    with relay_mod.RelayServer(collector, window_s=0.5) as n:
        yield n


def _send_all(url: str, frames: list[tuple[str, bytes]]) -> list[sender.Result]:
    """Each frame from its own sender (a rank), all at once; their results in order."""
    results: list[sender.Result | None] = [None] * len(frames)
    senders = [sender.Sender(sender.SenderConfig(collector_url=url)) for _ in frames]

    def one(i: int) -> None:
        batch_id, frame = frames[i]
        results[i] = senders[i].send(batch_id, 1, frame)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(frames))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in senders:
        s.close()
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _stored_steps(url: str, job: str) -> list[tuple[int, int]]:
    rows = httpx.get(
        f"{url}/api/v1/jobs/{job}/steps", params={"step_start": 0, "step_end": 999}, timeout=10
    ).json()
    return sorted((r["rank"], r["step"]) for r in rows)


def test_ranks_frames_go_together_and_each_sender_gets_its_own_answer(
    collector: str, node: relay_mod.RelayServer
) -> None:
    job = "relay-a"
    everyone = rec.steps(8, 4, job=job)
    frames = [
        (f"ra-{r}", codec.encode_batch([s for s in everyone if s.rank == r], batch_id=f"ra-{r}"))
        for r in range(8)
    ]
    bad = ("ra-bad", codec.encode_batch([rec.sample("n", 1.0, float("nan"))], batch_id="ra-bad"))
    results = _send_all(node.url, [*frames, bad])
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 8 + [Outcome.REJECTED]
    assert "Sample.value: must be a finite number" in results[-1].detail
    assert _stored_steps(collector, job) == [(r, s) for r in range(8) for s in range(4)]
    # Nine frames, far fewer requests to the collector.
    assert node.stats.frames == 9
    assert node.stats.requests <= 3, node.stats
    # A retried frame is answered as committed (a duplicate) and stored once.
    again = _send_all(node.url, frames[:2])
    assert [r.outcome for r in again] == [Outcome.COMMITTED] * 2
    assert len(_stored_steps(collector, job)) == 32


def test_ranks_flushing_on_their_own_clocks_fall_into_step(collector: str) -> None:
    """Eight ranks flushing every 0.3 s from scattered phases, as SDK flushers do (wait, then
    send): the first window gathers whoever comes within it, and ranks answered together flush
    together after it, so later windows hold every rank."""
    n = relay_mod.RelayServer(collector, window_s=0.4)
    rounds, ranks = 6, 8
    everyone = rec.steps(ranks, rounds, job="relay-clock")
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def rank(r: int) -> None:
        s = sender.Sender(sender.SenderConfig(collector_url=n.url))
        time.sleep(0.3 * r / ranks)  # scattered phases
        for k in range(rounds):
            time.sleep(0.3)
            mine = [x for x in everyone if x.rank == r and x.step == k]
            got = s.send(f"c-{r}-{k}", 1, codec.encode_batch(mine, batch_id=f"c-{r}-{k}"))
            with lock:
                outcomes.append(got.outcome)
        s.close()

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert outcomes == [Outcome.COMMITTED] * rounds * ranks
        assert len(_stored_steps(collector, "relay-clock")) == rounds * ranks
        # One request per flush once in step (the first window may take two).
        assert n.stats.requests <= rounds + 2, n.stats
    finally:
        n.close()


def test_a_collector_away_is_a_retry_for_the_sender() -> None:
    away = f"http://127.0.0.1:{free_port()}"
    n = relay_mod.RelayServer(away, window_s=0.1, timeout_s=1.0)
    try:
        frame = codec.encode_batch(rec.steps(1, 1), batch_id="away-1")
        (result,) = _send_all(n.url, [("away-1", frame)])
        # A 502 each try: the sender spools it and retries later (an outage is never poison).
        assert result.outcome is Outcome.REFUSED and result.refusals == 3
        assert "HTTP 502" in result.detail and "unreachable" in result.detail
    finally:
        n.close()


def test_a_collector_without_the_frames_path_gets_each_frame_alone() -> None:
    old = Receiver(token="tok")  # answers 404 on every path but the lone ingest path
    n = relay_mod.RelayServer(old.url, window_s=0.5)
    try:
        frames = [
            (f"o-{i}", codec.encode_batch(rec.steps(1, 2), batch_id=f"o-{i}")) for i in range(4)
        ]
        senders = [
            sender.Sender(sender.SenderConfig(collector_url=n.url, token="tok")) for _ in frames
        ]
        results: list[sender.Result] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            got = senders[i].send(frames[i][0], 2, frames[i][1])
            with lock:
                results.append(got)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [r.outcome for r in results] == [Outcome.COMMITTED] * 4
        assert sorted(old.batch_ids) == [f"o-{i}" for i in range(4)]
        # Each sender's own token travelled with its frame: a wrong one is refused.
        (wrong,) = _send_all_with_token(n.url, "nope", "o-x")
        assert wrong.outcome is Outcome.UNAVAILABLE and "HTTP 401" in wrong.detail
        for s in senders:
            s.close()
    finally:
        n.close()
        old.stop()


def _send_all_with_token(url: str, token: str, batch_id: str) -> list[sender.Result]:
    s = sender.Sender(sender.SenderConfig(collector_url=url, token=token))
    try:
        return [s.send(batch_id, 1, codec.encode_batch(rec.steps(1, 1), batch_id=batch_id))]
    finally:
        s.close()


def test_bad_requests_to_the_relay_get_a_clear_answer(node: relay_mod.RelayServer) -> None:
    r = httpx.post(node.url + "/api/v1/jobs", content=b"x", timeout=10)
    assert r.status_code == 404 and "/api/v1/ingest" in r.json()["detail"]
    r = httpx.post(
        node.url + "/api/v1/ingest",
        content=b"x",
        headers={"content-type": "text/plain"},
        timeout=10,
    )
    assert r.status_code == 415
    r = httpx.post(
        node.url + "/api/v1/ingest",
        content=b"GIF89a",
        headers={"content-type": "application/x-vigil-batch"},
        timeout=10,
    )
    assert r.status_code == 422 and "not a vigil batch" in r.json()["detail"]


def test_relay_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="window_s"):
        relay_mod.Relay("http://127.0.0.1:1", window_s=0)
    with pytest.raises(ValueError, match="max_bytes"):
        relay_mod.Relay("http://127.0.0.1:1", max_bytes=relay_mod.MAX_BODY_BYTES + 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--relay-port", "9465"], "--relay-port needs a collector to relay to"),
        (["--relay-port", "70000", "--collector", "http://127.0.0.1:1"], "relay_port must be"),
        (
            ["--relay-port", "0", "--relay-window", "0", "--collector", "http://127.0.0.1:1"],
            "relay_window_s must be > 0",
        ),
        (["--relay-port", "{taken}", "--collector", "http://127.0.0.1:1"], "cannot listen"),
    ],
)
def test_vigil_agent_refuses_a_relay_it_cannot_run(
    tmp_path: Path, args: list[str], message: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = [a.replace("{taken}", str(taken.getsockname()[1])) for a in args]
        done = subprocess.run(
            [
                *(sys.executable, "-m", "vigil", "agent", "--no-nvml", "--metrics-port", "0"),
                *("--progress-dir", str(tmp_path / "pages"), *argv),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "VIGIL_COLLECTOR_URL": ""},
        )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("vigil agent: ") and message in last, done.stderr
