"""kill -9 the collector (a real uvicorn process) mid-stream: every acked batch is stored once.

A sender streams batches and retries each until it is acknowledged, as the SDK's shipper does.
Halfway through, the collector gets SIGKILL and is restarted on the same store and port. Each
batch carries 500 append-only samples tagged with the batch number, so a lost batch shows up as
missing samples and a batch stored twice as doubled ones.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from tests.collector import records as rec
from vigil import api, codec, schema
from vigil.collector import Store, StoreConfig, tables

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
NUM_BATCHES = 40
SAMPLES_PER_BATCH = 500
RANKS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Collector:
    """`python -m vigil collector` as a subprocess."""

    def __init__(self, store_url: str, data_dir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = data_dir / "collector.log"
        argv = [
            sys.executable,
            "-m",
            "vigil",
            "collector",
            "--port",
            str(port),
            "--store",
            store_url,
        ]
        env = {**os.environ, "VIGIL_DATA_DIR": str(data_dir), "VIGIL_LOG_LEVEL": "INFO"}
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("collector did not become healthy: " + self.log.read_text())

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _batch(i: int) -> bytes:
    records: list[schema.Record] = [
        rec.sample("node-0", float(j), float(i)) for j in range(SAMPLES_PER_BATCH)
    ]
    records += [rec.step(r, i) for r in range(RANKS)]
    return codec.encode_batch(records, batch_id=f"batch-{i}")


class Sender(threading.Thread):
    """Sends batches in order; retries each (backoff) until a 2xx, like the SDK shipper."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.acked: list[int] = []
        self.retries = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=10) as client:
                for i in range(NUM_BATCHES):
                    self._send(client, i)
        except BaseException as exc:
            self.error = exc

    def _send(self, client: httpx.Client, i: int) -> None:
        frame, delay, deadline = _batch(i), 0.05, time.monotonic() + 90
        headers = {"content-type": api.BATCH_MEDIA_TYPE, api.BATCH_ID_HEADER: f"batch-{i}"}
        while time.monotonic() < deadline:
            try:
                r = client.post(f"{self.url}{api.INGEST_PATH}", content=frame, headers=headers)
                if r.status_code == 200:
                    self.acked.append(i)
                    return
                assert r.status_code >= 500, r.text  # a 4xx would be a bug in this test
            except httpx.TransportError:
                pass
            self.retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        raise TimeoutError(f"batch {i} never acknowledged")


@pytest.mark.timeout(240)
def test_kill_9_mid_stream_loses_and_duplicates_nothing(store_url: str, tmp_path: Path) -> None:
    port = _free_port()
    collector = Collector(store_url, tmp_path, port)
    sender = Sender(collector.url)
    try:
        sender.start()
        while len(sender.acked) < NUM_BATCHES // 3 and sender.is_alive():
            time.sleep(0.005)
        acked_before_kill = len(sender.acked)
        collector.kill()
        assert 0 < acked_before_kill < NUM_BATCHES
        time.sleep(0.5)  # the sender now meets a dead port and retries
        collector = Collector(store_url, tmp_path, port)
        sender.join(timeout=150)
        assert sender.error is None, sender.error
        assert sender.acked == list(range(NUM_BATCHES)) and sender.retries > 0
    finally:
        collector.stop()
    assert "auth is off, serving 127.0.0.1" in collector.log.read_text()

    store = Store(StoreConfig(url=store_url))
    try:
        with store.read() as conn:
            per_batch = dict(
                conn.execute(
                    select(tables.samples.c.value, func.count()).group_by(tables.samples.c.value)
                ).all()
            )
            num_batches = conn.execute(
                select(func.count()).select_from(tables.batches)
            ).scalar_one()
            num_steps = conn.execute(
                select(func.count()).select_from(tables.step_records)
            ).scalar_one()
    finally:
        store.close()
    assert per_batch == {float(i): SAMPLES_PER_BATCH for i in range(NUM_BATCHES)}
    assert num_batches == NUM_BATCHES and num_steps == NUM_BATCHES * RANKS
