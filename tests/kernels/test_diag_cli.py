"""`vigil diag` end to end on CPU, shipping to a real HTTP endpoint that speaks the ingest contract.

No collector service exists on this branch, so a stdlib HTTP server on loopback stands in for
one: it decodes each batch with vigil.codec and answers with scripted status codes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from vigil import api, cli, codec, schema
from vigil.kernels import healthy, run_node, ship, suite


class Ingest:
    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.batches: list[schema.Batch] = []
        self.headers: list[dict[str, str]] = []


@pytest.fixture
def ingest() -> Iterator[tuple[str, Ingest]]:
    state = Ingest([])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.headers.append(dict(self.headers))
            status = state.statuses.pop(0) if state.statuses else 200
            if status == 200 and self.path == api.INGEST_PATH:
                batch = codec.decode_batch(body)
                state.batches.append(batch)
                reply: dict[str, Any] = {"batch_id": batch.batch_id, "accepted": len(batch.records)}
            else:
                reply = {"detail": "DiagResult.value: scripted failure"}
            payload = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None: ...

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def _lines(out: str) -> list[schema.DiagResult]:
    records = [codec.decode_json(line) for line in out.splitlines() if line.strip()]
    assert all(isinstance(r, schema.DiagResult) for r in records)
    return records  # type: ignore[return-value]


@pytest.mark.e2e
def test_quick_diag_runs_every_cpu_diagnostic_and_ships_the_results(
    ingest: tuple[str, Ingest],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    url, state = ingest
    monkeypatch.setenv("VIGIL_TOKEN", "s3cret")
    monkeypatch.setenv("VIGIL_DATA_DIR", str(tmp_path))
    code = cli.main(["diag", "--quick", "--json", "--node", "ci-node", "--collector", url])
    results = _lines(capsys.readouterr().out)
    tests = {r.test for r in results}
    assert code == 0, [r for r in results if r.verdict in ("fail", "suspect")]
    for expected in (
        "gemm.fp32.torch",
        "stream.copy.torch",
        "pcie.h2d",
        "sdc.mismatches",
        "sdc.checksum",
        "memtest.failing_words",
        "memtest.bandwidth",
        "coll.all_reduce.1MiB.busbw",
    ):
        assert expected in tests
    by_test = {r.test: r for r in results}
    assert by_test["gemm.fp32.torch"].value > 0 and by_test["gemm.fp32.torch"].unit == "TFLOP/s"
    assert by_test["sdc.mismatches"].verdict == "pass"
    assert by_test["coll.all_reduce.1MiB.busbw"].device == "node"
    assert {r.node for r in results} == {"ci-node"}
    (batch,) = state.batches
    assert batch.records == results and batch.source == "vigil-diag"
    headers = {k.lower(): v for k, v in state.headers[0].items()}
    assert headers["content-type"] == api.BATCH_MEDIA_TYPE
    assert headers[api.BATCH_ID_HEADER.lower()] == batch.batch_id
    assert headers["authorization"] == "Bearer s3cret"


def test_a_node_worse_than_the_fleet_is_suspect_and_exits_nonzero(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    baseline = tmp_path / "fleet.json"
    # A fleet whose CPUs are 1000x faster: this node is far more than 5 % below its median.
    baseline.write_text(json.dumps({"gemm.fp32.torch": 1000.0}))
    code = cli.main(["diag", "--json", "--only", "gemm", "--baseline", str(baseline)])
    (result,) = _lines(capsys.readouterr().out)
    assert code == 1
    assert (result.test, result.baseline, result.verdict) == ("gemm.fp32.torch", 1000.0, "suspect")


def test_human_output_is_a_table_with_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["diag", "--only", "sdc"]) == 0
    out = capsys.readouterr().out
    assert "sdc.mismatches" in out and "pass" in out


def test_unknown_diagnostic_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown diagnostics"):
        cli.main(["diag", "--only", "gemm,warp-drive"])


def _records() -> list[schema.DiagResult]:
    return [schema.DiagResult(node="n1", device="GPU-1", test="gemm.bf16.triton", value=700.0)]


def test_shipping_retries_server_errors_then_succeeds(ingest: tuple[str, Ingest]) -> None:
    url, state = ingest
    state.statuses = [503, 502]
    waits: list[float] = []
    outcome = ship.send(_records(), ship.ShipConfig(url=url, backoff_s=0.1), sleep=waits.append)
    assert outcome.delivery == "accepted" and waits == [0.1, 0.2]
    assert len(state.batches) == 1 and state.batches[0].batch_id == outcome.batch_id
    # Every attempt carried the same batch id, so the collector stores the batch once.
    ids = {h.get(api.BATCH_ID_HEADER) or h.get(api.BATCH_ID_HEADER.lower()) for h in state.headers}
    assert ids == {outcome.batch_id}


def test_shipping_never_retries_a_rejection(ingest: tuple[str, Ingest]) -> None:
    url, state = ingest
    state.statuses = [400]
    outcome = ship.send(_records(), ship.ShipConfig(url=url), sleep=lambda _s: None)
    assert outcome.delivery == "rejected" and "scripted failure" in outcome.detail
    assert len(state.headers) == 1


def test_an_unreachable_collector_spools_the_batch(tmp_path: Path) -> None:
    # Nothing listens on this port: every attempt fails to connect, then the frame is spooled.
    with httpx.Client() as client:
        config = ship.ShipConfig(url="http://127.0.0.1:9", attempts=2, spool_dir=tmp_path)
        outcome = ship.send(_records(), config, client=client, sleep=lambda _s: None)
    assert outcome.delivery == "spooled"
    (spooled,) = tmp_path.glob("*.vgl")
    assert codec.decode_batch(spooled.read_bytes()).records == _records()


def test_run_node_is_an_in_process_preflight_api() -> None:
    results = run_node(suite.Level.QUICK, only={"sdc", "gemm"}, node="preflight-node")
    assert {r.test for r in results} >= {"sdc.mismatches", "sdc.checksum", "gemm.fp32.torch"}
    assert {r.node for r in results} == {"preflight-node"}
    assert healthy(results)
    failed = [
        schema.DiagResult(
            node="n", device="cpu", test="sdc.mismatches", value=1.0, verdict=schema.Verdict.FAIL
        )
    ]
    assert not healthy(results + failed)


def test_the_cli_catalog_names_every_diagnostic_of_the_plan() -> None:
    import dataclasses

    assert tuple(f.name for f in dataclasses.fields(suite.SuitePlan)) == suite.DIAGNOSTICS
