"""A real collector under hostile and absurd input: bounded memory, bounded work, nothing wedged.

Starts `vigil collector` (SQLite, its streaming analyzer, a token with both scopes) as a
subprocess, measures a baseline of normal ingests (a 64-rank job posting one step's records and
heartbeats per batch), then runs each attack one at a time, each followed by normal traffic.
Per attack it prints: the statuses answered, peak and retained RSS of the collector over the
baseline taken before the first attack (so both are cumulative: each attack's figure includes
what the earlier ones left), the analyzer's queue 5 s later, and the median latency of normal
ingests after the attack as a ratio to the baseline median (both measured in this run).

Attacks (issue #23): a step counter jumping to 2**52 and one in Unix seconds; 2**62 steps; a
Finding with 1,000,000 evidence entries and one with 5,000,000 subject ranks; a 22 KB zstd
batch inflating to 4.85 M heartbeats, alone and four at once; a 65 KB gzip Kineto bomb; a job
declaring 200,000 ranks; a job declaring 131,072 ranks whose rank 131,071 alone reports 40
steps, then a heatmap read of them; a batch of ranks near the maximum; 2,000 distinct jobs;
300 half-sent requests; 2**63-1 and NUL in a batch id.

Last line, one JSON object: {"attacks", "server_errors", "max_peak_rss_mib",
"max_retained_rss_mib", "max_latency_ratio_after", "analyzer_stuck"}. Targets: 0 server
errors, peak <= 256 MiB, retained <= 128 MiB, latency ratio <= 3, nothing stuck.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil
import zstandard

from vigil import api, codec, schema

TOKEN = "abuse-bench"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HEADERS = {"content-type": api.BATCH_MEDIA_TYPE, **AUTH}
NORMAL_RANKS = 64
MIB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Collector:
    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "VIGIL_DATA_DIR": str(workdir),
            "VIGIL_TOKEN": TOKEN,
            "VIGIL_LOG_LEVEL": "WARNING",
        }
        self.log = (workdir / "collector.log").open("w")
        argv = [sys.executable, "-m", "vigil", "collector", "--port", str(self.port)]
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise SystemExit("collector did not start; see " + self.log.name)

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def pending(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("vigil_collector_analyzer_pending "):
                return float(line.split()[1])
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


class RssSampler(threading.Thread):
    """The collector's peak RSS while an attack runs (sampled every 10 ms)."""

    def __init__(self, collector: Collector) -> None:
        super().__init__(daemon=True)
        self.collector = collector
        self.peak = collector.rss()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, self.collector.rss())
            except psutil.Error:
                return
            time.sleep(0.01)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


def _post(client: httpx.Client, frame: bytes, timeout: float = 30.0) -> int:
    try:
        return client.post(
            api.INGEST_PATH, content=frame, headers=HEADERS, timeout=timeout
        ).status_code
    except httpx.TimeoutException:
        return 0  # no answer in time


def _normal_frame(step: int) -> bytes:
    now = time.time()
    records: list[schema.Record] = [
        schema.StepRecord(
            job_id="normal", rank=r, step=step, start_s=now - 0.5, end_s=now, tokens=4096
        )
        for r in range(NORMAL_RANKS)
    ]
    records += [
        schema.Heartbeat(job_id="normal", rank=r, time_s=now, last_step=step)
        for r in range(NORMAL_RANKS)
    ]
    return codec.encode_batch(records)


class Normal:
    """The well-behaved job: its ingest latencies."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.step = 0
        job = schema.Job(job_id="normal", world_size=NORMAL_RANKS)
        assert _post(client, codec.encode_batch([job])) == 200

    def latencies(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            frame = _normal_frame(self.step)
            self.step += 1
            started = time.perf_counter()
            status = _post(self.client, frame)
            out.append(time.perf_counter() - started)
            if status != 200:
                raise SystemExit(f"normal ingest answered {status}")
        return out


# --- attacks: each returns the statuses it got ----------------------------------------------


def _steps_frame(job: str, steps: list[int], ranks: list[int], world: int | None = None) -> bytes:
    records: list[schema.Record] = []
    if world is not None:
        records.append(schema.Job(job_id=job, world_size=world))
    records += [
        schema.StepRecord(job_id=job, rank=r, step=s, start_s=1.0, end_s=1.5)
        for s in steps
        for r in ranks
    ]
    return codec.encode_batch(records)


def step_jump(c: httpx.Client, col: Collector) -> list[int]:
    return [
        _post(c, _steps_frame("jump", [0], [0, 1], world=2)),
        _post(c, _steps_frame("jump", [2**52], [0, 1])),
        _post(c, _steps_frame("jump", [2**52 + 1, 2**52 + 2, 2**52 + 3], [0, 1])),
    ]


def step_unix_seconds(c: httpx.Client, col: Collector) -> list[int]:
    start = int(time.time())
    return [
        _post(c, _steps_frame("unix", [s], [0, 1], world=2))
        for s in (0, start, start + 1, start + 2)
    ]


def step_2_62(c: httpx.Client, col: Collector) -> list[int]:
    return [
        _post(c, _steps_frame("big-step", [0], [0])),
        _post(c, _steps_frame("big-step", [2**62], [0])),
    ]


def _raw_frame(records_msgpack: bytes, count: int, compress: bool = True) -> bytes:
    head = b"\x83" + msgspec.msgpack.encode("v") + msgspec.msgpack.encode(schema.SCHEMA_VERSION)
    head += msgspec.msgpack.encode("batch_id") + msgspec.msgpack.encode(codec.new_batch_id())
    head += msgspec.msgpack.encode("records") + b"\xdd" + count.to_bytes(4, "big")
    payload = head + records_msgpack
    if not compress:
        return codec.MAGIC + b"\x00" + payload
    return (
        codec.MAGIC
        + bytes([codec.FLAG_ZSTD])
        + zstandard.ZstdCompressor(level=19).compress(payload)
    )


def finding_evidence(c: httpx.Client, col: Collector) -> list[int]:
    ev = msgspec.msgpack.encode({"metric": "m", "observed": 1.0})
    body = msgspec.msgpack.encode(
        {"type": "finding", "finding_id": "f", "kind": "hang", "job_id": "j", "evidence": []}
    )
    # Replace the empty evidence array (0x90) by 1,000,000 entries.
    prefix = body[:-1]
    records = prefix + b"\xdd" + (1_000_000).to_bytes(4, "big") + ev * 1_000_000
    return [_post(c, _raw_frame(records, 1))]


def finding_ranks(c: httpx.Client, col: Collector) -> list[int]:
    body = msgspec.msgpack.encode(
        {
            "type": "finding",
            "finding_id": "f2",
            "kind": "hang",
            "job_id": "j",
            "subjects": {"ranks": []},
        }
    )
    prefix = body[:-1]
    n = 5_000_000
    records = prefix + b"\xdd" + n.to_bytes(4, "big") + b"\x01" * n
    return [_post(c, _raw_frame(records, 1))]


def _heartbeat_bomb() -> bytes:
    beat = msgspec.msgpack.encode({"type": "heartbeat", "job_id": "b", "rank": 0, "time_s": 1.0})
    return _raw_frame(beat * 4_850_000, 4_850_000)


def heartbeat_bomb(c: httpx.Client, col: Collector) -> list[int]:
    return [_post(c, _heartbeat_bomb())]


def heartbeat_bomb_x4(c: httpx.Client, col: Collector) -> list[int]:
    frame = _heartbeat_bomb()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [httpx.Client(base_url=col.url) for _ in range(4)]
        try:
            return list(pool.map(lambda cl: _post(cl, frame), clients))
        finally:
            for cl in clients:
                cl.close()


def kineto_bomb(c: httpx.Client, col: Collector) -> list[int]:
    body = b'{"traceEvents":[' + b"{}," * 20_000_000 + b"{}]}"
    packed = gzip.compress(body, 9)
    r = c.post("/api/v1/jobs/j/traces", content=packed, headers=AUTH, timeout=60)
    return [r.status_code]


def kineto_bomb_events(c: httpx.Client, col: Collector) -> list[int]:
    body = b'{"traceEvents":[' + b'{"ph":"X"},' * 6_000_000 + b'{"ph":"X"}]}'
    packed = gzip.compress(body, 9)
    r = c.post("/api/v1/jobs/j/traces", content=packed, headers=AUTH, timeout=60)
    return [r.status_code]


def world_200k(c: httpx.Client, col: Collector) -> list[int]:
    return [
        _post(c, codec.encode_batch([schema.Job(job_id="w200k", world_size=200_000)])),
        _post(c, codec.encode_batch([schema.Job(job_id="w400k", world_size=400_000)])),
    ]


def top_rank(c: httpx.Client, col: Collector) -> list[int]:
    statuses = [_post(c, _steps_frame("top", list(range(40)), [131_071], world=131_072))]
    r = c.get("/api/v1/jobs/top/heatmap", params={"step_start": 0, "step_end": 39}, headers=AUTH)
    statuses.append(r.status_code)
    if r.status_code == 200:
        print(f"    heatmap read of the top rank: {len(r.content) / 1024:.1f} KiB", flush=True)
    return statuses


def ranks_near_max(c: httpx.Client, col: Collector) -> list[int]:
    ranks = [131_071 - i * 17 for i in range(2000)]
    return [_post(c, _steps_frame("near-max", [0, 1, 2], ranks, world=131_072))]


def many_jobs(c: httpx.Client, col: Collector) -> list[int]:
    statuses = []
    for start in range(0, 2000, 100):
        records: list[schema.Record] = [
            schema.StepRecord(job_id=f"many-{i}", rank=0, step=0, start_s=1.0, end_s=1.5)
            for i in range(start, start + 100)
        ]
        statuses.append(_post(c, codec.encode_batch(records)))
    return statuses


def half_sent(c: httpx.Client, col: Collector) -> list[int]:
    socks = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", col.port))
        s.sendall(b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    time.sleep(11.0)  # the default header deadline is 10 s
    closed = 0
    for s in socks:
        s.settimeout(1.0)
        with contextlib.suppress(TimeoutError, OSError):
            closed += s.recv(1) == b""
        s.close()
    print(f"    {closed} of 300 half-sent requests closed by the collector", flush=True)
    return [200 if closed == 300 else 0]


def odd_values(c: httpx.Client, col: Collector) -> list[int]:
    big = schema.StepRecord(job_id="odd", rank=0, step=1, start_s=1.0, end_s=2.0, tokens=2**63 - 1)
    nul = codec.encode_batch(
        [schema.Heartbeat(job_id="odd", rank=0, time_s=1.0)], batch_id="a\x00b"
    )
    return [_post(c, codec.encode_batch([big])), _post(c, nul)]


ATTACKS: list[tuple[str, Callable[[httpx.Client, Collector], list[int]]]] = [
    ("step jump to 2**52", step_jump),
    ("step counter in Unix seconds", step_unix_seconds),
    ("step 2**62", step_2_62),
    ("finding with 1M evidence entries", finding_evidence),
    ("finding with 5M subject ranks", finding_ranks),
    ("22 KB zstd of 4.85M heartbeats", heartbeat_bomb),
    ("the same, four at once", heartbeat_bomb_x4),
    ("65 KB-class gzip Kineto bomb ({} events)", kineto_bomb),
    ("gzip Kineto bomb of 6M tiny events", kineto_bomb_events),
    ("world size 200,000 and 400,000", world_200k),
    ("rank 131,071 of 131,072 alone, 40 steps + heatmap", top_rank),
    ("2,000 ranks near the maximum", ranks_near_max),
    ("2,000 distinct jobs", many_jobs),
    ("300 half-sent requests", half_sent),
    ("2**63-1 tokens, NUL in a batch id", odd_values),
]


@dataclass
class Result:
    name: str
    statuses: list[int]
    peak_mib: float
    retained_mib: float
    pending_after: float
    latency_ratio: float
    errors: int = field(init=False)

    def __post_init__(self) -> None:
        self.errors = sum(1 for s in self.statuses if s >= 500 or s == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--normal", type=int, default=20, help="normal ingests per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vigil-abuse-") as tmp:
        col = Collector(Path(tmp))
        try:
            results = run(col, args.normal)
        finally:
            col.stop()
    worst_peak = max(r.peak_mib for r in results)
    worst_kept = max(r.retained_mib for r in results)
    worst_ratio = max(r.latency_ratio for r in results)
    stuck = any(r.pending_after > 0 for r in results)
    errors = sum(r.errors for r in results)
    print(
        f"\n{len(results)} attacks: {errors} server errors or unanswered; worst peak "
        f"{worst_peak:.0f} MiB (target <= 256), worst retained {worst_kept:.0f} MiB "
        f"(target <= 128), worst latency ratio {worst_ratio:.2f} (target <= 3), analyzer "
        f"{'STUCK' if stuck else 'never stuck'}"
    )
    print(
        json.dumps(
            {
                "attacks": len(results),
                "server_errors": errors,
                "max_peak_rss_mib": round(worst_peak, 1),
                "max_retained_rss_mib": round(worst_kept, 1),
                "max_latency_ratio_after": round(worst_ratio, 2),
                "analyzer_stuck": stuck,
            }
        )
    )


def run(col: Collector, normal_n: int) -> list[Result]:
    client = httpx.Client(base_url=col.url)
    normal = Normal(client)
    normal.latencies(normal_n)  # warm up
    baseline_lat = statistics.median(normal.latencies(normal_n))
    baseline_rss = col.rss()
    print(
        f"baseline: normal ingest {baseline_lat * 1e3:.1f} ms (median of {normal_n}), "
        f"RSS {baseline_rss / MIB:.0f} MiB",
        flush=True,
    )
    print(
        f"{'attack':52s} {'statuses':18s} {'peak':>7s} {'kept':>7s} {'queue':>6s} {'latency':>8s}"
    )
    results = []
    for name, attack in ATTACKS:
        sampler = RssSampler(col)
        sampler.start()
        statuses = attack(client, col)
        time.sleep(1.0)
        peak = sampler.stop()
        time.sleep(4.0)
        pending = col.pending()
        lat = statistics.median(normal.latencies(normal_n))
        kept = col.rss()
        result = Result(
            name=name,
            statuses=statuses,
            peak_mib=max(0.0, (peak - baseline_rss) / MIB),
            retained_mib=max(0.0, (kept - baseline_rss) / MIB),
            pending_after=pending,
            latency_ratio=lat / baseline_lat,
        )
        results.append(result)
        shown = ",".join(map(str, sorted(set(statuses))))
        print(
            f"{name:52s} {shown:18s} {result.peak_mib:6.0f}M {result.retained_mib:6.0f}M "
            f"{pending:6.0f} {result.latency_ratio:7.2f}x",
            flush=True,
        )
    client.close()
    return results


if __name__ == "__main__":
    main()
