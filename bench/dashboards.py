"""Dashboard queries at scale: a real Prometheus scraping a synthetic 1,024-rank job.

    python bench/dashboards.py [--ranks 1024] [--per-node 8] [--scrape 5] [--warmup 90]

128 synthetic node agents (8 ranks each by default) run the agent's real exporter
(`vigil.agent.exporter`) over synthetic pages, GPU readings (the agent's NVML sampler driving a
stand-in NVML) and host readings, served over HTTP (tests/dashboards/synthetic.py); 4 ranks are
stragglers. A real `vigil collector` (SQLite) holds the job's records (1,024 ranks x 5 steps,
collective aggregates, findings, a restart record, a checkpoint), so the collector's job series
are real too. Debian's Prometheus scrapes all of them every `--scrape` seconds with vigil's rule
files loaded. After `--warmup` seconds every panel's queries run as Grafana runs them (a range
query over the data scraped so far, step = the scrape interval; `$__rate_interval` = 4 scrapes)
three times each: median milliseconds (min-max of the three beside the slowest) and the series
returned.

Side by side in the same run: the job's step-time p50 from its recording rule vs the same
quantile over the raw per-rank series, and the top-k panel's series with the k pinned over the
range (`@ end()`) vs a plain `topk` (which keeps k new series per step).

Last line: one JSON object with `panels`, `max_query_ms`, `max_series_per_timeseries_panel`
(timeseries and status-history panels, all their queries), `series_per_rank` (every vigil
series the agents export, per rank), and the figures around them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.agent import conftest  # noqa: E402
from tests.dashboards import promql, synthetic  # noqa: E402
from tests.dashboards.prometheus import Prometheus  # noqa: E402
from vigil import api, codec, schema  # noqa: E402
from vigil.collector.grafana import dashboards, rules  # noqa: E402

JOB = "bench-1024"
STRAGGLERS = {5, 300, 301, 777}
TARGET_MS, TARGET_SERIES = 500.0, 50


def _collector(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = conftest.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vigil", "collector", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--store", f"sqlite:///{work / 'collector.sqlite3'}", "--no-analyzer"]
    log = open(work / "collector.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "VIGIL_DATA_DIR": str(work / "data")},
    )  # fmt: skip
    conftest.poll_until(lambda: _up(url), timeout_s=60, what="the collector")
    return proc, url


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _post(url: str, records: list[schema.Record]) -> None:
    response = httpx.post(
        url + api.INGEST_PATH,
        content=codec.encode_batch(records),
        headers={"content-type": api.BATCH_MEDIA_TYPE},
        timeout=120,
    )
    response.raise_for_status()


def _job_records(ranks: int, per_node: int, now: float) -> list[list[schema.Record]]:
    """The job's records in batches: what its SDKs and recovery would have sent."""
    head: list[schema.Record] = [schema.Job(job_id=JOB, world_size=ranks)]
    head += [
        schema.RankInfo(job_id=JOB, rank=r, node=f"node-{r // per_node:04d}", world_size=ranks)
        for r in range(ranks)
    ]
    steps: list[schema.Record] = []
    aggs: list[schema.Record] = []
    for s in range(5):
        start = now - 60 + s
        for r in range(ranks):
            slow = 0.4 if r in STRAGGLERS else 0.0
            steps.append(
                schema.StepRecord(
                    job_id=JOB, rank=r, step=s, start_s=start, end_s=start + 1.0 + 0.4,
                    data_s=0.01, comm_wait_s=0.8 - slow, tokens=8192, mfu=0.4,
                )
            )  # fmt: skip
            if s == 4:
                for group in ("world", f"tp:{r // 8}", f"dp:{r % 8}"):
                    aggs.append(
                        schema.CollectiveAggregate(
                            job_id=JOB, rank=r, step=s, group=group, op="all_reduce", count=2,
                            total_device_s=0.2, last_seq=s,
                        )
                    )  # fmt: skip
    crash = schema.Finding(
        finding_id=f"{JOB}-crash", kind=schema.FindingKind.CRASH, job_id=JOB, detected_s=now - 50
    )
    tail: list[schema.Record] = [
        crash,
        schema.Finding(
            finding_id=f"{JOB}-slow", kind=schema.FindingKind.STRAGGLER, job_id=JOB,
            subjects=schema.Subjects(ranks=sorted(STRAGGLERS)), detected_s=now - 40,
        ),
        schema.Action(
            action_id=f"{JOB}-crash/0-restart", kind=schema.ActionKind.RESTART, job_id=JOB,
            finding_id=crash.finding_id, state=schema.ActionState.SUCCEEDED, end_s=now - 45,
            attempt=1, resume_step=2, steps_lost=2, recovered_s=now - 42,
        ),
        schema.Action(
            action_id=f"{JOB}-slow/0-migrate", kind=schema.ActionKind.MIGRATE, job_id=JOB,
            target="node-0000", state=schema.ActionState.SUCCEEDED, end_s=now - 30,
        ),
        schema.Checkpoint(job_id=JOB, step=3, location="/ckpt/3", blocked_s=0.5),
    ]  # fmt: skip
    return [head, steps, aggs, tail]


def _beat(url: str) -> None:
    """Rank 0's heartbeat, so the collector counts the job as running."""
    _post(url, [schema.Heartbeat(job_id=JOB, rank=0, time_s=time.time(), last_step=4)])


SPREAD: dict[str, tuple[float, float]] = {}  # expression -> (min, max) ms of its runs


def _timed(call: Any, repeat: int = 3, key: str = "") -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = call()
        times.append((time.perf_counter() - started) * 1000)
    SPREAD[key] = (min(times), max(times))
    return statistics.median(times), result


def _panels(prom: Prometheus, window_s: float, step_s: float) -> list[dict[str, Any]]:
    values = {"namespace": ".*", "job": JOB, "node": ".*", "rank": ".*",
              "__rate_interval": f"{int(4 * step_s)}s", "__range": f"{int(window_s)}s"}  # fmt: skip
    rows = []
    for board in dashboards.all_dashboards().values():
        for panel in board["panels"]:
            worst_ms, series = 0.0, 0
            for target in panel["targets"]:
                expr = promql.substitute(target["expr"], values)
                if target["instant"]:
                    ms, result = _timed(lambda e=expr: prom.query(e), key=expr)
                else:
                    ms, result = _timed(
                        lambda e=expr: prom.query_range(e, seconds=window_s, step_s=step_s),
                        key=expr,
                    )
                if ms >= worst_ms:
                    spread = SPREAD[expr]
                worst_ms, series = max(worst_ms, ms), series + len(result)
            rows.append(
                {"dashboard": board["uid"], "panel": panel["title"], "type": panel["type"],
                 "ms": round(worst_ms, 2), "series": series,
                 "spread_ms": [round(spread[0], 2), round(spread[1], 2)]}
            )  # fmt: skip
    return rows


def _side_by_side(prom: Prometheus, window_s: float, step_s: float) -> dict[str, Any]:
    rank = f'{{job_id="{JOB}"}}'
    recorded_ms, _ = _timed(
        lambda: prom.query_range(f"{rules.STEP_P50}{rank}", seconds=window_s, step_s=step_s)
    )
    raw = f"quantile by (job_id) (0.5, {rules.STEP_TIME}{rank})"
    raw_ms, _ = _timed(lambda: prom.query_range(raw, seconds=window_s, step_s=step_s))
    compute = rules.compute(rank)
    naive = prom.query_range(f"topk(10, {compute})", seconds=window_s, step_s=step_s)
    pinned_expr = promql.substitute(
        dashboards.pinned(
            "topk", compute, "job_id, rank", dashboards.over_range(compute, subquery=True)
        ),
        {"__range": f"{int(window_s)}s", "__rate_interval": f"{int(4 * step_s)}s"},
    )
    pinned = prom.query_range(pinned_expr, seconds=window_s, step_s=step_s)
    return {
        "p50_recorded_ms": round(recorded_ms, 2),
        "p50_raw_ms": round(raw_ms, 2),
        "p50_raw_over_recorded": round(raw_ms / max(recorded_ms, 1e-3), 2),
        "topk_naive_series": len(naive),
        "topk_pinned_series": len(pinned),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--scrape", type=float, default=5.0, help="scrape interval, seconds")
    parser.add_argument("--warmup", type=float, default=90.0, help="seconds of data first")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vigil-bench-dashboards-"))
    started = time.time()
    collector, url = _collector(work)
    exporters: list[synthetic.Exporter] = []
    prom = None
    try:
        for batch in _job_records(args.ranks, args.per_node, started):
            _post(url, batch)
        refused = httpx.post(url + api.INGEST_PATH, content=b"VGL\x00?", timeout=10)
        assert refused.status_code >= 400  # one refusal, so the refusals panel has a series
        _beat(url)
        for first in range(0, args.ranks, args.per_node):
            ranks = list(range(first, min(first + args.per_node, args.ranks)))
            view = synthetic.node_view(
                job=JOB, node=f"node-{first // args.per_node:04d}", ranks=ranks,
                world=args.ranks, stragglers=STRAGGLERS, started_s=started,
            )  # fmt: skip
            exporters.append(synthetic.Exporter(view))
        prom = Prometheus(
            work,
            {
                "vigil-agent": [e.target for e in exporters],
                "vigil-collector": [url.removeprefix("http://")],
            },
            rule_files=sorted((ROOT / "dashboards" / "rules").glob("*.rules.yml")),
            interval_s=args.scrape,
        )
        deadline = time.monotonic() + args.warmup
        while time.monotonic() < deadline:
            time.sleep(min(20.0, max(0.0, deadline - time.monotonic())))
            _beat(url)
        window = args.warmup
        rows = _panels(prom, window, args.scrape)
        side = _side_by_side(prom, window, args.scrape)
        agent_series = prom.query('count({job="vigil-agent", __name__=~"vigil_.*"})')
        refresh = prom.query("max(vigil_collector_job_metrics_refresh_seconds)")
    finally:
        if prom is not None:
            prom.stop()
        for e in exporters:
            e.close()
        os.killpg(collector.pid, signal.SIGTERM)
        collector.wait(30)
    for row in rows:
        print(f"{row['ms']:8.2f} ms {row['series']:5d} series  {row['dashboard']}: {row['panel']}")
    empty = [f"{r['dashboard']}: {r['panel']}" for r in rows if r["series"] == 0]
    plotted = [r for r in rows if r["type"] in ("timeseries", "status-history")]
    times = [r["ms"] for r in rows]
    total = float(agent_series[0]["value"][1]) if agent_series else 0.0
    print(
        f"p50 step time: recording rule {side['p50_recorded_ms']} ms vs raw quantile "
        f"{side['p50_raw_ms']} ms ({side['p50_raw_over_recorded']}x); slowest-compute panel: "
        f"{side['topk_pinned_series']} series pinned vs {side['topk_naive_series']} plain topk"
    )
    summary = {
        "panels": len(rows),
        "max_query_ms": max(times),
        "max_query_spread_ms": max(rows, key=lambda r: r["ms"])["spread_ms"],
        "slowest_panel": max(rows, key=lambda r: r["ms"])["panel"],
        "median_query_ms": round(statistics.median(times), 2),
        "max_series_per_timeseries_panel": max(r["series"] for r in plotted),
        "series_per_rank": round(total / args.ranks, 2),
        "ranks": args.ranks,
        "nodes": len(exporters),
        "scrape_interval_s": args.scrape,
        "data_window_s": window,
        "panels_without_series": empty,
        "collector_job_metrics_refresh_s": float(refresh[0]["value"][1]) if refresh else None,
        **side,
        "targets": {"max_query_ms": TARGET_MS, "max_series_per_timeseries_panel": TARGET_SERIES},
        "met": max(times) <= TARGET_MS and max(r["series"] for r in plotted) <= TARGET_SERIES,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
