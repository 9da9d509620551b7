"""Collector ingest throughput beside a raw bulk insert of the same rows, on SQLite and PostgreSQL.

For each store, in one run:
  - HTTP ingest: a real `vigil collector` (uvicorn) subprocess pinned to one core receives
    pre-encoded batches (msgpack+zstd frames of `--batch-steps` steps x `--ranks` step records,
    packed as the columnar step block, as vigil's senders ship them) over keep-alive HTTP
    from this process on another core: decode, validate, idempotency row,
    step rows, heatmap matrix, commit, ack.
  - raw insert: the same rows written straight into the same table of a fresh store with the
    same settings, one transaction per batch, on the collector's core, by the fastest known
    method: SQLite (WAL + synchronous=FULL) one prepared `executemany` per transaction;
    PostgreSQL one binary COPY per transaction through psycopg, the whole stream handed over in
    one `write` and laid out beforehand, untimed (numpy, `writes.step_copy`: the collector's
    own layout), so the raw figure is the database's cost alone; the layout's own rate is
    printed beside it. (Before #21 the PostgreSQL baseline formatted each row with psycopg's
    `write_row`, slower than what the collector does.)
The two alternate in chunks of 16 batches, so both meet the same load on a shared machine; an
HTTP chunk's time runs until the collector's streaming analyzer has also processed it (that work
follows each ack and belongs to ingest). Each of `--rounds` rounds starts both on fresh stores;
the figures are the medians over rounds (the ratio: of each round's own ratio), printed with
their spread (min-max) and the targets (>= 100,000 rows/s and >= 0.5 x raw on each store).
Then a `--ranks` x `--steps` heatmap query is timed end to end over HTTP until the body is in
(median of 5, spread beside it). The last line of output is one JSON object:
{"sqlite_rows_per_s", "sqlite_ratio_to_raw", "postgres_rows_per_s", "postgres_ratio_to_raw",
 "heatmap_query_ms"} (medians; the heatmap on the embedded SQLite store), and beside them
{"sqlite_raw_rows_per_s", "postgres_raw_rows_per_s", "<store>_rows_per_s_spread",
 "<store>_ratio_spread", "heatmap_query_ms_spread", "rounds"} (spreads are [min, max]).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg

from vigil import api, codec, columns, schema
from vigil.collector import Store, StoreConfig, writes

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
def collector(
    url: str,
    data_dir: Path,
    core: int,
    *,
    analyzer: bool = True,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    port = _free_port()
    env = {
        **os.environ,
        "VIGIL_DATA_DIR": str(data_dir),
        "VIGIL_LOG_LEVEL": "WARNING",
        **(env or {}),
    }
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
    """The same rows straight into the same table: one prepared executemany per transaction."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, timeout=30)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        cols = ", ".join(writes.STEP_COLUMNS)
        marks = ", ".join("?" * len(writes.STEP_COLUMNS))
        self.sql = f"INSERT INTO step_records ({cols}) VALUES ({marks})"

    @staticmethod
    def prepare(records: list[schema.StepRecord]) -> list[tuple[object, ...]]:
        return [writes.as_row(r) for r in records]

    def insert(self, rows: list[tuple[object, ...]]) -> None:
        self.conn.executemany(self.sql, rows)  # one statement, prepared once, all the rows
        self.conn.commit()

    def count(self) -> int:
        return int(self.conn.execute("SELECT count(*) FROM step_records").fetchone()[0])

    def close(self) -> None:
        self.conn.close()


class RawPostgres:
    """The same rows straight into the same table: one binary COPY per transaction, its whole
    stream (laid out beforehand) handed to psycopg in one write."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        cols = ", ".join(writes.STEP_COLUMNS)
        self.sql = f"COPY step_records ({cols}) FROM STDIN (FORMAT BINARY)"

    @staticmethod
    def prepare(records: list[schema.StepRecord]) -> bytes:
        """The rows' binary COPY stream, as the collector lays it out from a batch's block."""
        block = columns.to_block(records)
        assert block is not None, "bench records fit the columnar block"
        return writes.step_copy(columns.from_block(block))

    def insert(self, stream: bytes) -> None:
        with self.conn.cursor() as cur, cur.copy(self.sql) as copy:
            copy.write(stream)
        self.conn.commit()

    def count(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM step_records").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.conn.close()


def prepared(chunks: list[list[schema.StepRecord]]) -> tuple[dict[str, list[Any]], float]:
    """Each store's raw batches, and the rows/s at which PostgreSQL's COPY streams were laid
    out (untimed in the raw figure; printed beside it)."""
    t0 = time.perf_counter()
    streams = [RawPostgres.prepare(c) for c in chunks]
    layout_rate = sum(map(len, chunks)) / (time.perf_counter() - t0)
    return {"sqlite": [RawSqlite.prepare(c) for c in chunks], "postgres": streams}, layout_rate


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


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
    raw_batches: list[Any],
    cores: tuple[int, int],
    rows: int,
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
            for batch in raw_batches[first : first + chunk]:
                raw.insert(batch)
            raw_s += time.perf_counter() - t0
            os.sched_setaffinity(0, {client_core})
    return rows / http_s, rows / raw_s


def fresh_store(url: str) -> None:
    store = Store(StoreConfig(url=url))
    store.migrate()
    store.close()


def heatmap_ms(base: str, ranks: int, steps: int, repeats: int = 5) -> list[float]:
    """Each repeat's time (ms) until the heatmap's body is in (parsing is the client's)."""
    times = []
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
            times.append((time.perf_counter() - t0) * 1000)
            body = r.json()
    assert len(body["values"]) == steps and len(body["values"][0]) == ranks, "heatmap shape"
    return times


def measure(
    name: str, args: argparse.Namespace, tmp: str, pg: pgcluster.PostgresServer, data: Any
) -> dict[str, Any]:
    """Every round's HTTP and raw rows/s on store `name`, and the heatmap query's times."""
    frames, raw_batches, cores, rows = data
    http, raw_rates, heatmap = [], [], []
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
            http_rate, raw_rate = interleaved(base, raw, frames, raw_batches, cores, rows)
            if round_ == 0:
                heatmap = heatmap_ms(base, args.ranks, args.steps)
        stored = raw.count()
        raw.close()
        assert stored == rows, f"raw {name} insert stored {stored} of {rows} rows"
        http.append(http_rate)
        raw_rates.append(raw_rate)
        print(
            f"  {name} round {round_}: HTTP {http_rate:,.0f} rows/s, raw {raw_rate:,.0f} rows/s, "
            f"ratio {http_rate / raw_rate:.3f} "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
        )
    return {"http": http, "raw": raw_rates, "heatmap_ms": heatmap}


def summarize(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """Medians and spreads of one store's rounds, printed beside the targets."""
    http = median_spread(result["http"])
    raw = median_spread(result["raw"])
    ratio = median_spread([h / r for h, r in zip(result["http"], result["raw"], strict=True)])
    print(
        f"{name:9s} HTTP ingest {http[0]:10,.0f} rows/s ({http[1]:,.0f}-{http[2]:,.0f}; "
        f"target >= 100,000) | raw {raw[0]:10,.0f} rows/s ({raw[1]:,.0f}-{raw[2]:,.0f}) | "
        f"ratio {ratio[0]:5.3f} ({ratio[1]:.3f}-{ratio[2]:.3f}; target >= 0.5)"
    )
    return {
        "rows_per_s": round(http[0]),
        "ratio_to_raw": round(ratio[0], 3),
        "raw_rows_per_s": round(raw[0]),
        "rows_per_s_spread": [round(http[1]), round(http[2])],
        "ratio_spread": [round(ratio[1], 3), round(ratio[2], 3)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported")
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
    raw_batches, layout_rate = prepared(chunks)
    print(
        f"rows: {len(records):,} step records ({args.ranks} ranks x {args.steps} steps), batches "
        f"of {per_batch:,}; medians of {args.rounds} rounds (min-max beside); collector pinned "
        f"to core {cores[0]}"
    )
    print(
        "raw baselines: SQLite one prepared executemany per transaction; PostgreSQL one binary "
        f"COPY per transaction from streams laid out beforehand ({layout_rate:,.0f} rows/s, "
        "not timed)"
    )
    pg = pgcluster.start(durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="vigil-bench-") as tmp:
            results = {
                name: measure(name, args, tmp, pg, (frames, raw_batches[name], cores, len(records)))
                for name in ("sqlite", "postgres")
            }
    finally:
        pg.stop()
    sqlite, postgres = (summarize(name, results[name]) for name in ("sqlite", "postgres"))
    heatmap = median_spread(results["sqlite"]["heatmap_ms"])
    print(
        f"heatmap {args.ranks}x{args.steps} (SQLite) {heatmap[0]:.1f} ms "
        f"({heatmap[1]:.1f}-{heatmap[2]:.1f}, 5 queries)"
    )
    figures: dict[str, Any] = {
        "sqlite_rows_per_s": sqlite.pop("rows_per_s"),
        "sqlite_ratio_to_raw": sqlite.pop("ratio_to_raw"),
        "postgres_rows_per_s": postgres.pop("rows_per_s"),
        "postgres_ratio_to_raw": postgres.pop("ratio_to_raw"),
        "heatmap_query_ms": round(heatmap[0], 1),
    }
    figures.update({f"sqlite_{k}": v for k, v in sqlite.items()})
    figures.update({f"postgres_{k}": v for k, v in postgres.items()})
    figures["heatmap_query_ms_spread"] = [round(heatmap[1], 1), round(heatmap[2], 1)]
    figures["rounds"] = args.rounds
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
