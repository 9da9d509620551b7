"""Collector ingest throughput beside a raw bulk insert of the same rows, on SQLite and PostgreSQL.

For each store, in one run:
  - HTTP ingest: a real `vigil collector` (uvicorn) subprocess pinned to one core receives
    pre-encoded batches (msgpack+zstd frames of `--batch-steps` steps x `--ranks` step records,
    packed as the columnar step block, as vigil's senders ship them) over keep-alive HTTP
    from this process on another core: decode, validate, idempotency row,
    step rows, heatmap matrix, commit, ack.
  - raw insert: the same rows written straight into the same table of a fresh store with the
    same settings (SQLite: WAL + synchronous=FULL, executemany; PostgreSQL: binary COPY), one
    transaction per batch, on the collector's core.
The two alternate in chunks of 16 batches, so both meet the same load on a shared machine; an
HTTP chunk's time runs until the collector's streaming analyzer has also processed it (that work
follows each ack and belongs to ingest). The round with the best ratio of `--rounds` is
reported. Then a `--ranks` x `--steps` heatmap query is
timed end to end over HTTP until the body is in (best of 5). The last line of output is one
JSON object:
{"sqlite_rows_per_s", "sqlite_ratio_to_raw", "postgres_rows_per_s", "postgres_ratio_to_raw",
 "heatmap_query_ms"} (the heatmap on the embedded SQLite store).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg

from vigil import api, codec, schema
from vigil.collector import Store, StoreConfig, dialects, tables, writes

# The throwaway PostgreSQL is test support (tests/support/), not shipped: the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import pgcluster

JOB = "bench"


def step_records(ranks: int, steps: range, seed: int = 0) -> list[schema.StepRecord]:
    rng = random.Random(seed)
    out = []
    for step in steps:
        for rank in ranks_range(ranks):
            start = 1.7e9 + step * 0.5 + rng.random() * 1e-3
            out.append(
                schema.StepRecord(
                    job_id=JOB,
                    rank=rank,
                    step=step,
                    start_s=start,
                    end_s=start + 0.5 + rng.random() * 0.01,
                    data_s=0.01,
                    forward_s=0.12,
                    backward_s=0.25,
                    optimizer_s=0.03,
                    comm_wait_s=rng.random() * 0.05,
                    tokens=8192,
                    model_flops=1.2e15,
                    mfu=0.41,
                    loss=2.5 + rng.random(),
                    peak_memory_bytes=60 << 30,
                )
            )
    return out


def ranks_range(ranks: int) -> range:
    return range(ranks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def collector(url: str, data_dir: Path, core: int, *, analyzer: bool = True) -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "VIGIL_DATA_DIR": str(data_dir), "VIGIL_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [
            sys.executable,
            *("-m", "vigil", "collector", "--port", str(port), "--store", url),
            *(() if analyzer else ("--no-analyzer",)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    os.sched_setaffinity(proc.pid, {core})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"collector exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            time.sleep(0.2)
        else:
            raise RuntimeError("collector did not become healthy within 60 s")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class RawSqlite:
    """The same rows straight into the same table: executemany, one transaction per batch."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, timeout=30)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        cols = ", ".join(writes.STEP_COLUMNS)
        marks = ", ".join("?" * len(writes.STEP_COLUMNS))
        self.sql = f"INSERT INTO step_records ({cols}) VALUES ({marks})"

    def insert(self, rows: list[tuple[object, ...]]) -> None:
        self.conn.executemany(self.sql, rows)
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()


class RawPostgres:
    """The same rows straight into the same table: binary COPY, one transaction per batch."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        cols = ", ".join(writes.STEP_COLUMNS)
        self.sql = f"COPY step_records ({cols}) FROM STDIN (FORMAT BINARY)"
        self.types = dialects.copy_types(tables.step_records, writes.STEP_COLUMNS)

    def insert(self, rows: list[tuple[object, ...]]) -> None:
        with self.conn.cursor() as cur, cur.copy(self.sql) as copy:
            copy.set_types(self.types)
            for row in rows:
                copy.write_row(row)
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()


def analyzed(client: httpx.Client, timeout_s: float = 120.0) -> None:
    """Wait until the collector's streaming analyzer has caught up with every acked batch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = client.get("/metrics").text
        pending = next(
            (
                float(line.split()[1])
                for line in text.splitlines()
                if line.startswith("vigil_collector_analyzer_pending ")
            ),
            0.0,
        )
        if pending == 0:
            return
        time.sleep(0.005)
    raise RuntimeError("the collector's analyzer did not catch up")


def interleaved(
    base: str,
    raw: RawSqlite | RawPostgres,
    frames: list[tuple[str, bytes]],
    raw_batches: list[list[tuple[object, ...]]],
    cores: tuple[int, int],
    chunk: int = 16,
) -> tuple[float, float]:
    """Chunk by chunk, alternately through HTTP and raw, so that both paths meet the same load
    on this shared machine; returns (http_rows_per_s, raw_rows_per_s). An HTTP chunk ends when
    the collector has also analysed it: its streaming analyzer works after each ack, and that
    work is part of ingest (it must not spill into the raw insert's time)."""
    server_core, client_core = cores
    http_s = raw_s = 0.0
    with httpx.Client(base_url=base, timeout=120) as client:
        for first in range(0, len(frames), chunk):
            t0 = time.perf_counter()
            for batch_id, frame in frames[first : first + chunk]:
                headers = {"content-type": api.BATCH_MEDIA_TYPE, api.BATCH_ID_HEADER: batch_id}
                client.post(api.INGEST_PATH, content=frame, headers=headers).raise_for_status()
            analyzed(client)
            http_s += time.perf_counter() - t0
            os.sched_setaffinity(0, {server_core})  # the raw insert runs on the server's core
            t0 = time.perf_counter()
            for rows in raw_batches[first : first + chunk]:
                raw.insert(rows)
            raw_s += time.perf_counter() - t0
            os.sched_setaffinity(0, {client_core})
    total = sum(map(len, raw_batches))
    return total / http_s, total / raw_s


def fresh_store(url: str) -> None:
    store = Store(StoreConfig(url=url))
    store.migrate()
    store.close()


def heatmap_ms(base: str, ranks: int, steps: int, repeats: int = 5) -> float:
    best = float("inf")
    with httpx.Client(base_url=base, timeout=60) as client:
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = client.get(
                f"/api/v1/jobs/{JOB}/heatmap",
                params={
                    "metric": "step_time",
                    "step_start": 0,
                    "step_end": steps - 1,
                    "max_steps": steps,
                },
            )
            r.raise_for_status()
            best = min(best, time.perf_counter() - t0)  # the answer is in; parsing is the client's
            body = r.json()
    assert len(body["values"]) == steps and len(body["values"][0]) == ranks, "heatmap shape"
    return best * 1000


def measure(
    name: str, args: argparse.Namespace, tmp: str, pg: pgcluster.PostgresServer, data: Any
) -> dict[str, float]:
    frames, raw_batches, cores = data
    best = {"http": 0.0, "raw": 0.0, "ratio": 0.0, "heatmap_ms": float("nan")}
    for round_ in range(args.rounds):
        urls = [
            f"sqlite:///{tmp}/{name}-{round_}-{kind}.sqlite3"
            if name == "sqlite"
            else pg.new_database()
            for kind in ("http", "raw")
        ]
        fresh_store(urls[1])
        raw: RawSqlite | RawPostgres = (
            RawSqlite(Path(urls[1].removeprefix("sqlite:///")))
            if name == "sqlite"
            else RawPostgres(urls[1])
        )
        with collector(urls[0], Path(tmp), cores[0], analyzer=not args.no_analyzer) as base:
            http_rate, raw_rate = interleaved(base, raw, frames, raw_batches, cores)
            if round_ == 0:
                best["heatmap_ms"] = heatmap_ms(base, args.ranks, args.steps)
        raw.close()
        print(
            f"  {name} round {round_}: HTTP {http_rate:,.0f} rows/s, raw {raw_rate:,.0f} rows/s "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
        )
        if http_rate / raw_rate > best["ratio"]:
            best.update(http=http_rate, raw=raw_rate, ratio=http_rate / raw_rate)
    print(
        f"{name:9s} HTTP ingest {best['http']:12,.0f} rows/s | raw bulk insert "
        f"{best['raw']:12,.0f} rows/s | ratio {best['ratio']:5.2f} | "
        f"heatmap {args.ranks}x{args.steps} {best['heatmap_ms']:7.1f} ms"
    )
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--no-analyzer",
        action="store_true",
        help="run the collector without its streaming analyzer (ingest alone)",
    )
    args = parser.parse_args()
    cores = (0, 1) if (os.cpu_count() or 1) > 1 else (0, 0)  # (server, client)
    os.sched_setaffinity(0, {cores[1]})

    records = step_records(args.ranks, range(args.steps))
    per_batch = args.ranks * args.batch_steps
    chunks = [records[i : i + per_batch] for i in range(0, len(records), per_batch)]
    frames = [(f"b{i}", codec.encode_batch(c, batch_id=f"b{i}")) for i, c in enumerate(chunks)]
    raw_batches = [[writes.as_row(r) for r in c] for c in chunks]
    print(
        f"rows: {len(records):,} step records ({args.ranks} ranks x {args.steps} steps), batches "
        f"of {per_batch:,}; best ratio of {args.rounds} rounds; collector pinned to core {cores[0]}"
    )
    pg = pgcluster.start(durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="vigil-bench-") as tmp:
            data = (frames, raw_batches, cores)
            results = {name: measure(name, args, tmp, pg, data) for name in ("sqlite", "postgres")}
    finally:
        pg.stop()
    print(
        json.dumps(
            {
                "sqlite_rows_per_s": round(results["sqlite"]["http"]),
                "sqlite_ratio_to_raw": round(results["sqlite"]["ratio"], 3),
                "postgres_rows_per_s": round(results["postgres"]["http"]),
                "postgres_ratio_to_raw": round(results["postgres"]["ratio"], 3),
                "heatmap_query_ms": round(results["sqlite"]["heatmap_ms"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
