"""Per-rank batches into one collector, with group commit beside one transaction per batch.

Every rank's SDK ships its own batch each flush (1 s): a job of R ranks sends a collector R
small batches a second. Here a simulated job's ranks (`--ranks`, 0.25 s steps: a batch holds 4
step records as the columnar block, their 8 collective aggregates and a heartbeat, framed as the
SDK frames them) are posted by `--senders` concurrent keep-alive clients on one core to a real
`vigil collector` (uvicorn, its streaming analyzer on) pinned to the other, on SQLite and on
PostgreSQL. Each round starts two collectors on fresh stores, one with group commit (the
default) and one with `VIGIL_INGEST_GROUP_COMMIT=0` (each batch in its own transaction, as before
group commit), and alternates between them chunk by chunk (`--chunk` batches), so both meet the
same load on this shared machine; a chunk ends when every batch of it was acknowledged. The
figures are the medians over `--rounds` rounds with their spread (min-max); the speedup is the
median of each round's own ratio.

The last line is one JSON object: {"sqlite_batches_per_s", "sqlite_batches_per_s_one_each",
"sqlite_group_commit_speedup", "postgres_batches_per_s", "postgres_batches_per_s_one_each",
"postgres_group_commit_speedup", each with its "_spread" ([min, max]), "senders", "ranks",
"rounds"}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from ingest import collector, median_spread

from vigil import api, codec

# The simulator and the throwaway PostgreSQL are test support (tests/support/): the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import pgcluster
from tests.support import simulator as sim

STEPS_PER_BATCH = 4


def rank_frames(ranks: int, windows: int) -> tuple[bytes, list[bytes]]:
    """(the job's description frame, every rank's batch of each window), as senders frame them."""
    job = sim.ScenarioConfig(
        job_id="ranks", num_ranks=ranks, num_steps=windows * STEPS_PER_BATCH, compute_s=0.2,
        data_s=0.01, transfer_s=0.04, seed=3,
    )  # fmt: skip
    s = sim.simulate(job)
    head = codec.encode_batch(list(next(s.records())))
    frames = []
    for w in range(windows):
        by_rank = collections.defaultdict(list)
        for i in range(w * STEPS_PER_BATCH, (w + 1) * STEPS_PER_BATCH):
            for r in s.step_records(i):
                by_rank[r.rank].append(r)
        frames += [codec.encode_batch(records) for records in by_rank.values()]
    return head, frames


class Senders:
    """`n` keep-alive clients posting frames concurrently; `post_all` returns when all are in."""

    def __init__(self, base: str, n: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=n)
        self.local = threading.local()
        self.base = base

    def _post(self, frame: bytes) -> None:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = httpx.Client(base_url=self.base, timeout=120)
        headers = {"content-type": api.BATCH_MEDIA_TYPE}
        client.post(api.INGEST_PATH, content=frame, headers=headers).raise_for_status()

    def post_all(self, frames: list[bytes]) -> float:
        """Seconds until every frame was acknowledged."""
        t0 = time.perf_counter()
        for future in [self.pool.submit(self._post, f) for f in frames]:
            future.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


def one_round(
    urls: tuple[str, str], tmp: Path, frames: list[bytes], head: bytes, args: argparse.Namespace
) -> tuple[float, float]:
    """Batches a second (group commit, one transaction each) over the same frames."""
    cores = (0, 1) if (os.cpu_count() or 1) > 1 else (0, 0)
    one_each = {"VIGIL_INGEST_GROUP_COMMIT": "0"}
    with (
        collector(urls[0], tmp, cores[0]) as grouped,
        collector(urls[1], tmp, cores[0], env=one_each) as alone,
    ):
        os.sched_setaffinity(0, {cores[1]})
        arms = [Senders(grouped, args.senders), Senders(alone, args.senders)]
        try:
            for arm in arms:
                arm.post_all([head])
            spent = [0.0, 0.0]
            for k, first in enumerate(range(0, len(frames), args.chunk)):
                chunk = frames[first : first + args.chunk]
                for i in (0, 1) if k % 2 == 0 else (1, 0):
                    spent[i] += arms[i].post_all(chunk)
        finally:
            for arm in arms:
                arm.close()
    return len(frames) / spent[0], len(frames) / spent[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--windows", type=int, default=12, help="flushes of every rank")
    parser.add_argument("--senders", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for name in ("ranks", "windows", "senders", "chunk", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    head, frames = rank_frames(args.ranks, args.windows)
    print(
        f"{len(frames)} batches ({args.ranks} ranks x {args.windows} flushes of "
        f"{STEPS_PER_BATCH} steps) from {args.senders} concurrent senders; {args.rounds} rounds"
    )
    figures: dict[str, Any] = {}
    pg = pgcluster.start(durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="vigil-bench-") as tmp:
            for store in ("sqlite", "postgres"):
                grouped, alone = [], []
                for r in range(args.rounds):
                    urls = tuple(
                        f"sqlite:///{tmp}/{store}-{r}-{arm}.sqlite3"
                        if store == "sqlite"
                        else pg.new_database()
                        for arm in ("grouped", "alone")
                    )
                    g, a = one_round(urls, Path(tmp), frames, head, args)  # type: ignore[arg-type]
                    grouped.append(g)
                    alone.append(a)
                    print(f"  {store} round {r}: group commit {g:,.0f} batches/s, one "
                          f"transaction each {a:,.0f} batches/s ({g / a:.2f}x)")  # fmt: skip
                g_med, g_lo, g_hi = median_spread(grouped)
                a_med, a_lo, a_hi = median_spread(alone)
                ratios = [g / a for g, a in zip(grouped, alone, strict=True)]
                x_med, x_lo, x_hi = median_spread(ratios)
                print(f"{store}: group commit {g_med:,.0f} batches/s ({g_lo:,.0f}-{g_hi:,.0f}), "
                      f"one each {a_med:,.0f} ({a_lo:,.0f}-{a_hi:,.0f}), {x_med:.2f}x "
                      f"({x_lo:.2f}-{x_hi:.2f})")  # fmt: skip
                figures[f"{store}_batches_per_s"] = round(g_med)
                figures[f"{store}_batches_per_s_spread"] = [round(g_lo), round(g_hi)]
                figures[f"{store}_batches_per_s_one_each"] = round(a_med)
                figures[f"{store}_batches_per_s_one_each_spread"] = [round(a_lo), round(a_hi)]
                figures[f"{store}_group_commit_speedup"] = round(x_med, 2)
                figures[f"{store}_group_commit_speedup_spread"] = [round(x_lo, 2), round(x_hi, 2)]
    finally:
        pg.stop()
    figures.update(senders=args.senders, ranks=args.ranks, rounds=args.rounds)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
