"""`vigil diag`'s shipping goes through the core sender: retried with its backoff schedule, spooled
while the collector is away, and replayed by the next run (its own spool, what older versions
left there, and the sibling spools of runs that have exited); without a spool an undelivered
batch is reported lost.

Real HTTP on loopback to `tests.agent.receiver.Receiver` (the ingest contract); spools are real
folders, their dead owners real exited processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.agent import conftest, receiver
from vigil import codec, schema, spool
from vigil.kernels import ship

pytestmark = pytest.mark.integration


def _result(test: str, value: float = 1.0) -> schema.DiagResult:
    return schema.DiagResult(node="n1", device="cpu", test=test, value=value)


def _config(url: str, spool_dir: Path | None, **options: object) -> ship.ShipConfig:
    return ship.ShipConfig(url=url, spool_dir=spool_dir, backoff_s=0.01, **options)  # type: ignore[arg-type]


def _tests(collector: receiver.Receiver) -> list[str]:
    return [r.test for r in collector.records if isinstance(r, schema.DiagResult)]


def _no_wait(_s: float) -> None:
    pass


def test_a_run_while_the_collector_is_away_is_delivered_by_the_next_run(tmp_path: Path) -> None:
    port = conftest.free_port()  # nobody listens until the second run
    url, spool_dir = f"http://127.0.0.1:{port}", tmp_path / "diag"
    first = ship.send([_result("gemm.fp32.torch")], _config(url, spool_dir), sleep=_no_wait)
    assert first.delivery is ship.Delivery.SPOOLED and first.detail == str(spool_dir)
    collector = receiver.Receiver(port)
    try:
        second = ship.send([_result("sdc.mismatches")], _config(url, spool_dir), sleep=_no_wait)
        assert second.delivery is ship.Delivery.ACCEPTED
        # The earlier run's batch went first, under its own batch id; nothing is left behind.
        assert _tests(collector) == ["gemm.fp32.torch", "sdc.mismatches"]
        assert collector.batch_ids == [first.batch_id, second.batch_id]
        third = ship.send([_result("pcie.h2d")], _config(url, spool_dir), sleep=_no_wait)
        assert third.delivery is ship.Delivery.ACCEPTED and collector.requests == 3  # once each
    finally:
        collector.stop()
    assert list(spool_dir.glob("*.vgl")) == []


def test_server_errors_follow_the_core_backoff_schedule(tmp_path: Path) -> None:
    collector = receiver.Receiver(fail_first=10**9)  # 503 to everything
    waits: list[float] = []
    try:
        config = ship.ShipConfig(url=collector.url, spool_dir=tmp_path / "diag", backoff_s=0.25)
        outcome = ship.send([_result("gemm.fp32.torch")], config, sleep=waits.append)
        # 4 attempts: backoff_s, then doubling (the formula diag used before, now the core's).
        assert waits == [0.25, 0.5, 1.0] and collector.requests == 4
        assert outcome.delivery is ship.Delivery.SPOOLED
        collector.fail_first = 0
        again = ship.send([_result("sdc.mismatches")], config, sleep=waits.append)
        assert again.delivery is ship.Delivery.ACCEPTED
        assert _tests(collector) == ["gemm.fp32.torch", "sdc.mismatches"]
    finally:
        collector.stop()


def test_a_refused_token_is_retried_later_not_rejected(tmp_path: Path) -> None:
    collector = receiver.Receiver(token="right")
    try:
        wrong = _config(collector.url, tmp_path / "diag", token="wrong")
        outcome = ship.send([_result("gemm.fp32.torch")], wrong, sleep=_no_wait)
        # 401 is the configuration's fault, not the batch's: it waits for the right token.
        assert outcome.delivery is ship.Delivery.SPOOLED and collector.requests == 1
        right = _config(collector.url, tmp_path / "diag", token="right")
        assert ship.send([_result("x")], right, sleep=_no_wait).delivery is ship.Delivery.ACCEPTED
        assert _tests(collector) == ["gemm.fp32.torch", "x"]
    finally:
        collector.stop()


def test_a_rejected_batch_is_kept_in_quarantine_and_never_resent(tmp_path: Path) -> None:
    collector = receiver.Receiver(answer=lambda _batch: 422)
    try:
        config = _config(collector.url, tmp_path / "diag")
        outcome = ship.send([_result("gemm.fp32.torch")], config, sleep=_no_wait)
        assert outcome.delivery is ship.Delivery.REJECTED and "422" in outcome.detail
        collector.answer = None
        ship.send([_result("sdc.mismatches")], config, sleep=_no_wait)
        assert _tests(collector) == ["sdc.mismatches"] and collector.requests == 2
    finally:
        collector.stop()
    (kept,) = (tmp_path / "diag" / spool.QUARANTINE_DIR).glob("*.vgl")
    assert codec.decode_batch(kept.read_bytes()).batch_id == outcome.batch_id


def test_without_a_spool_an_undelivered_batch_is_lost_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://127.0.0.1:{conftest.free_port()}"
    with httpx.Client() as client:
        outcome = ship.send([_result("gemm.fp32.torch")], _config(url, None), client=client)
    assert outcome.delivery is ship.Delivery.LOST and "ConnectError" in outcome.detail
    assert any("lost" in r.getMessage() for r in caplog.records)


def test_what_an_older_version_spooled_is_replayed(tmp_path: Path) -> None:
    spool_dir = tmp_path / "diag"
    spool_dir.mkdir()
    old_id = codec.new_batch_id()
    old = codec.encode_batch([_result("old.run")], batch_id=old_id, source="vigil-diag")
    (spool_dir / f"{old_id}.vgl").write_bytes(old)  # how diag spooled before the core sender
    collector = receiver.Receiver()
    try:
        ship.send([_result("new.run")], _config(collector.url, spool_dir), sleep=_no_wait)
        assert _tests(collector) == ["old.run", "new.run"] and collector.batch_ids[0] == old_id
    finally:
        collector.stop()
    assert list(spool_dir.glob("*.vgl")) == []


_LEAVE_A_SIBLING = """
import os, sys
from pathlib import Path
from vigil import codec, schema, spool
s = spool.Spool(Path(sys.argv[1]), max_bytes=1 << 20)
r = schema.DiagResult(node="n1", device="cpu", test="sibling.run", value=1.0)
s.push("sib", 1, codec.encode_batch([r], batch_id="sib", source="vigil-diag"))
os._exit(0)
"""


def test_the_next_run_replays_the_sibling_spool_of_a_run_that_exited(tmp_path: Path) -> None:
    # A run whose folder was busy spooled to a sibling, then exited (the kernel freed its lock).
    spool_dir = tmp_path / "diag"
    sibling = tmp_path / "diag.4242-1"
    subprocess.run([sys.executable, "-c", _LEAVE_A_SIBLING, str(sibling)], check=True, timeout=60)
    assert spool.siblings(spool_dir) == [sibling]
    collector = receiver.Receiver()
    try:
        ship.send([_result("this.run")], _config(collector.url, spool_dir), sleep=_no_wait)
        assert _tests(collector) == ["this.run", "sibling.run"]
    finally:
        collector.stop()
    assert not sibling.exists()
