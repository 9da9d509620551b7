"""Collector ingest throughput beside a raw bulk insert of the same rows, on SQLite and PostgreSQL.

For each store, in one run:
  - HTTP ingest: a real `vigil collector` (uvicorn) subprocess pinned to one core receives
    pre-encoded batches (msgpack+zstd frames of `--batch-steps` steps x `--ranks` step records)
    over keep-alive HTTP from this process on another core: decode, validate, idempotency row,
    step rows, heatmap matrix, commit, ack.
  - raw insert: the same rows written straight into the same table of a fresh store with the
    same settings (SQLite: WAL + synchronous=FULL, executemany; PostgreSQL: binary COPY), one
    transaction per batch, pinned to one core.
Each is the best of `--rounds`. Then a `--ranks` x 1,000-step heatmap query is timed end to end
over HTTP (best of 5). The last line of output is one JSON object:
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

import httpx
import psycopg

from vigil import api, codec, schema
from vigil.collector import Store, StoreConfig, dialects, pgcluster, tables, writes

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
def collector(url: str, data_dir: Path, core: int) -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "VIGIL_DATA_DIR": str(data_dir), "VIGIL_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vigil", "collector", "--port", str(port), "--store", url],
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


def http_ingest(base: str, frames: list[tuple[str, bytes]], rows: int) -> float:
    headers = {"content-type": api.BATCH_MEDIA_TYPE}
    with httpx.Client(base_url=base, timeout=120) as client:
        t0 = time.perf_counter()
        for batch_id, frame in frames:
            r = client.post(
                api.INGEST_PATH, content=frame, headers={**headers, api.BATCH_ID_HEADER: batch_id}
            )
            r.raise_for_status()
        elapsed = time.perf_counter() - t0
    return rows / elapsed


def raw_sqlite(path: Path, batches: list[list[tuple[object, ...]]]) -> float:
    conn = sqlite3.connect(path, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    cols = ", ".join(writes.STEP_COLUMNS)
    sql = f"INSERT INTO step_records ({cols}) VALUES ({', '.join('?' * len(writes.STEP_COLUMNS))})"
    t0 = time.perf_counter()
    for rows in batches:
        conn.executemany(sql, rows)
        conn.commit()
    elapsed = time.perf_counter() - t0
    conn.close()
    return sum(map(len, batches)) / elapsed


def raw_postgres(url: str, batches: list[list[tuple[object, ...]]]) -> float:
    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    cols = ", ".join(writes.STEP_COLUMNS)
    types = dialects.copy_types(tables.step_records, writes.STEP_COLUMNS)
    with psycopg.connect(dsn) as conn:
        t0 = time.perf_counter()
        for rows in batches:
            sql = f"COPY step_records ({cols}) FROM STDIN (FORMAT BINARY)"
            with conn.cursor() as cur, cur.copy(sql) as copy:
                copy.set_types(types)
                for row in rows:
                    copy.write_row(row)
            conn.commit()
        elapsed = time.perf_counter() - t0
    return sum(map(len, batches)) / elapsed


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    server_core, client_core = 0, min(1, os.cpu_count() or 1) if (os.cpu_count() or 1) > 1 else 0
    os.sched_setaffinity(0, {client_core})

    records = step_records(args.ranks, range(args.steps))
    per_batch = args.ranks * args.batch_steps
    chunks = [records[i : i + per_batch] for i in range(0, len(records), per_batch)]
    frames = [(f"b{i}", codec.encode_batch(c, batch_id=f"b{i}")) for i, c in enumerate(chunks)]
    raw_batches = [[writes._step_row(r) for r in c] for c in chunks]
    rows = len(records)
    print(
        f"rows: {rows:,} step records ({args.ranks} ranks x {args.steps} steps), "
        f"batches of {per_batch:,}, best of {args.rounds} rounds; server on core {server_core}"
    )

    results: dict[str, dict[str, float]] = {}
    pg = pgcluster.start(durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="vigil-bench-") as tmp:
            for name in ("sqlite", "postgres"):
                http_best, raw_best, heat = 0.0, 0.0, float("nan")
                for round_ in range(args.rounds):
                    url = (
                        f"sqlite:///{tmp}/{name}-{round_}-http.sqlite3"
                        if name == "sqlite"
                        else pg.new_database()
                    )
                    with collector(url, Path(tmp), server_core) as base:
                        http_best = max(http_best, http_ingest(base, frames, rows))
                        if round_ == 0:
                            heat = heatmap_ms(base, args.ranks, args.steps)
                    raw_url = (
                        f"sqlite:///{tmp}/{name}-{round_}-raw.sqlite3"
                        if name == "sqlite"
                        else pg.new_database()
                    )
                    fresh_store(raw_url)
                    os.sched_setaffinity(0, {server_core})
                    if name == "sqlite":
                        raw_best = max(
                            raw_best,
                            raw_sqlite(Path(raw_url.removeprefix("sqlite:///")), raw_batches),
                        )
                    else:
                        raw_best = max(raw_best, raw_postgres(raw_url, raw_batches))
                    os.sched_setaffinity(0, {client_core})
                results[name] = {"http": http_best, "raw": raw_best, "heatmap_ms": heat}
                print(
                    f"{name:9s} HTTP ingest {http_best:12,.0f} rows/s | raw bulk insert "
                    f"{raw_best:12,.0f} rows/s | ratio {http_best / raw_best:5.2f} | "
                    f"heatmap {args.ranks}x{args.steps} {heat:7.1f} ms"
                )
    finally:
        pg.stop()
    print(
        json.dumps(
            {
                "sqlite_rows_per_s": round(results["sqlite"]["http"]),
                "sqlite_ratio_to_raw": round(
                    results["sqlite"]["http"] / results["sqlite"]["raw"], 3
                ),
                "postgres_rows_per_s": round(results["postgres"]["http"]),
                "postgres_ratio_to_raw": round(
                    results["postgres"]["http"] / results["postgres"]["raw"], 3
                ),
                "heatmap_query_ms": round(results["sqlite"]["heatmap_ms"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
