"""The web UI at scale: a synthetic job of 10,000 ranks x 1,000 steps in the store, its heat map.

For each store (SQLite; PostgreSQL through tests/support/pgcluster when its binaries exist):
  - load: the job's step records go in through the store's bulk path (`Store.ingest` with
    columnar step blocks of `--batch-steps` steps, as vigil's senders ship them: step rows and
    the packed heat-map matrix in one transaction per batch); its rate is printed.
  - heat-map API: a real `vigil collector` subprocess answers the UI's full view
    (/ui/api/jobs/<job>/heatmap at the page's budget: 500 columns x 520 rows, each cell the worst
    of its block), timed end to end over HTTP until the body is in, median of `--rounds` with
    the spread; its payload in KB. Beside it, side by side, the query API's JSON heat map of the
    same columns (/api/v1/jobs/<job>/heatmap: every rank, means): time and payload ratios.
  - first paint: headless Chromium (Debian's, through Playwright) opens /ui/jobs/<job> and the
    page reports when the heat map was first drawn (performance.now() from navigation start),
    median of `--rounds` fresh page loads in one warm browser (each page's other reads finish
    before the next load).
One slow cell (8x; rank 7,777 at step 555 at the default size) is planted: each round checks
that the full view still shows it. The last line is one JSON object: {"heatmap_api_ms",
"heatmap_payload_kb", "first_paint_ms"} (medians on SQLite, the embedded default) beside the
spreads, the PostgreSQL figures (`postgres_*`), the JSON API's (`api_json_*`), load rates and
the targets (<= 300 ms, <= 2,048 KB, <= 2,000 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import pgcluster  # noqa: E402
from vigil import columns, schema  # noqa: E402
from vigil.collector import Store, StoreConfig, validate  # noqa: E402
from vigil.collector.ui import cells  # noqa: E402

JOB = "bench-ui-10k"
TARGETS = {"heatmap_api_ms": 300.0, "heatmap_payload_kb": 2048.0, "first_paint_ms": 2000.0}
CHROMIUM = "/usr/bin/chromium"
VIEW = {"max_cols": 500, "max_rows": 520}  # what the page asks for at 1,400 px


def median_spread(values: list[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slow_cell(ranks: int, steps: int) -> tuple[int, int]:
    return ranks * 7777 // 10_000, steps * 555 // 1000


def step_block(
    ranks: int, first: int, num_steps: int, steps_total: int, rng: np.random.Generator
) -> columns.StepColumns:
    """Columns of `num_steps` steps x `ranks` records: 0.5 s steps with 5 % noise."""
    n = ranks * num_steps
    values = np.zeros((n, len(columns.NUMERIC)))
    step = np.repeat(np.arange(first, first + num_steps), ranks)
    rank = np.tile(np.arange(ranks), num_steps)
    seconds = 0.5 * (1 + 0.05 * rng.random(n))
    slow_rank, slow_step = slow_cell(ranks, steps_total)
    seconds[(rank == slow_rank) & (step == slow_step)] = 4.0
    start = 1_700_000_000.0 + step * 0.6
    put = {
        "rank": rank,
        "step": step,
        "start_s": start,
        "end_s": start + seconds,
        "forward_s": seconds * 0.3,
        "backward_s": seconds * 0.5,
        "comm_wait_s": seconds * 0.1,
        "tokens": np.full(n, 4096.0),
        "mfu": 0.4 / (seconds / 0.5),
    }
    for name, column in put.items():
        values[:, columns.index(name)] = column
    return columns.StepColumns(values=values, job_ids=[JOB] * n, loss=np.full(n, np.nan))


def load(url: str, ranks: int, steps: int, batch_steps: int) -> float:
    """Rows per second through Store.ingest's columnar path."""
    store = Store(StoreConfig(url=url))
    store.migrate()
    job = schema.Job(job_id=JOB, name="10k-rank synthetic", world_size=ranks)
    store.ingest(schema.Batch(v=schema.SCHEMA_VERSION, batch_id="job", records=[job]))
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for first in range(0, steps, batch_steps):
        block = step_block(ranks, first, min(batch_steps, steps - first), steps, rng)
        batch = schema.Batch(v=schema.SCHEMA_VERSION, batch_id=f"steps-{first}", records=[])
        store.ingest(batch, validate.prepare_batch([], block))
    rate = ranks * steps / (time.perf_counter() - started)
    store.close()
    return rate


class Collector:
    def __init__(self, store_url: str, data_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VIGIL_DATA_DIR": str(data_dir), "VIGIL_LOG_LEVEL": "WARNING"}
        argv = [sys.executable, "-m", "vigil", "collector", "--port", str(self.port)]
        argv += ["--store", store_url, "--no-analyzer"]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("collector did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def time_get(client: httpx.Client, url: str, params: dict[str, Any]) -> tuple[float, bytes]:
    started = time.perf_counter()
    r = client.get(url, params=params, timeout=300)
    elapsed = (time.perf_counter() - started) * 1000
    r.raise_for_status()
    return elapsed, r.content


def measure_api(base: str, rounds: int, slow: tuple[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with httpx.Client() as client:
        ui_url = f"{base}/ui/api/jobs/{JOB}/heatmap"
        api_url = f"{base}/api/v1/jobs/{JOB}/heatmap"
        time_get(client, ui_url, VIEW)  # warm the store's page cache once
        ui_ms, api_ms = [], []
        body = b""
        for _ in range(rounds):  # alternate: both meet the same load
            ms, body = time_get(client, ui_url, VIEW)
            ui_ms.append(ms)
            header, grid = cells.decode(body)
            row = header["ranks"].index(slow[0]) // header["rank_stride"]
            col = (slow[1] - header["steps"][0]) // header["step_stride"]
            assert abs(float(grid[col, row]) - 4.0) < 1e-6, "the slow cell was averaged away"
            ms, api_body = time_get(
                client, api_url, {"step_start": 0, "max_steps": VIEW["max_cols"]}
            )
            api_ms.append(ms)
        out["heatmap_api_ms"], out["heatmap_api_ms_spread"] = median_spread(ui_ms)
        out["heatmap_payload_kb"] = len(body) / 1024
        out["heatmap_cells"] = [header["num_cols"], header["num_rows"]]
        out["api_json_ms"], out["api_json_ms_spread"] = median_spread(api_ms)
        out["api_json_payload_kb"] = len(api_body) / 1024
    return out


def measure_paint(base: str, rounds: int) -> tuple[float, list[float]]:
    from playwright.sync_api import sync_playwright

    painted = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for _ in range(rounds + 1):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/ui/jobs/{JOB}")
            page.wait_for_selector("canvas#heatmap[data-paints]", timeout=60_000)
            painted.append(float(page.evaluate("vigil.heat.firstPaintMs")))
            # Let the page's other reads (charts) finish, so the next load meets an idle server.
            deadline = time.monotonic() + 120
            while not page.evaluate("window.vigil.updated") and time.monotonic() < deadline:
                time.sleep(0.1)
            page.close()
        browser.close()
    return median_spread(painted[1:])  # the first load warms Chromium's caches


def run_store(name: str, url: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    rate = load(url, args.ranks, args.steps, args.batch_steps)
    print(
        f"{name}: loaded {args.ranks} x {args.steps} step records at {rate:,.0f} rows/s", flush=True
    )
    collector = Collector(url, tmp)
    try:
        figures = measure_api(collector.url, args.rounds, slow_cell(args.ranks, args.steps))
        figures["first_paint_ms"], figures["first_paint_ms_spread"] = measure_paint(
            collector.url, args.rounds
        )
    finally:
        collector.stop()
    figures["load_rows_per_s"] = rate
    print(
        f"{name}: heat map {figures['heatmap_api_ms']:.0f} ms (spread "
        f"{figures['heatmap_api_ms_spread'][0]:.0f}-{figures['heatmap_api_ms_spread'][1]:.0f}), "
        f"{figures['heatmap_payload_kb']:.0f} KB for {figures['heatmap_cells']} cells; "
        f"query API JSON {figures['api_json_ms']:.0f} ms, {figures['api_json_payload_kb']:.0f} KB "
        f"(x{figures['api_json_ms'] / figures['heatmap_api_ms']:.1f} time, "
        f"x{figures['api_json_payload_kb'] / figures['heatmap_payload_kb']:.1f} bytes); "
        f"first paint {figures['first_paint_ms']:.0f} ms",
        flush=True,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vigil-bench-ui-") as tmp_name:
        tmp = Path(tmp_name)
        sqlite = run_store("sqlite", f"sqlite:///{tmp / 'ui.sqlite3'}", tmp, args)
        results.update(sqlite)
        if not args.no_postgres:
            try:
                server = pgcluster.start()
            except (RuntimeError, FileNotFoundError, OSError) as exc:
                print(f"postgres: skipped ({exc})", flush=True)
            else:
                try:
                    pg = run_store("postgres", server.new_database(), tmp, args)
                    results.update({f"postgres_{k}": v for k, v in pg.items()})
                finally:
                    server.stop()
    results["ranks"], results["steps"], results["rounds"] = args.ranks, args.steps, args.rounds
    results["targets"] = TARGETS
    results["meets_targets"] = all(results[k] <= v for k, v in TARGETS.items())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
