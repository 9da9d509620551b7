"""Per-rank batches into one collector: group commit beside one transaction per batch, and
batches relayed by nodes beside both.

Every rank's SDK ships its own batch each flush (1 s): a job of R ranks sends a collector R
small batches a second. Here a simulated job's ranks (`--ranks`, 0.25 s steps: a batch holds 4
step records as the columnar block, their 8 collective aggregates and a heartbeat, framed as the
SDK frames them) are posted by `--senders` concurrent keep-alive clients on one core to real
`vigil collector`s (uvicorn, streaming analyzer on) pinned to the other, on SQLite and on
PostgreSQL. Each round starts three collectors on fresh stores: one with group commit (the
default), one with `VIGIL_INGEST_GROUP_COMMIT=0` (each batch in its own transaction, as before
group commit), and one that receives the same frames as a node agent's relay sends them: each
node's (`RANKS_PER_NODE` = 8 ranks) frames of one flush in one envelope to
`/api/v1/ingest/frames`, from one client per node. This arm measures the collector's side of the
relay; the relay's own hop costs the nodes' agents, not the collector (tests/agent/test_relay.py
shows real relays gathering a node's flush into one request). The arms take turns chunk by chunk
(`--chunk` batches, in a rotating order), so all meet the same load on this shared machine; a
chunk ends when every batch of it was acknowledged. The figures are the medians over `--rounds`
rounds with their spread (min-max); each speedup is the median of each round's own ratio.

The last line is one JSON object: {"sqlite_batches_per_s", "sqlite_batches_per_s_one_each",
"sqlite_batches_per_s_relayed", "sqlite_group_commit_speedup" (group commit / one each),
"sqlite_relay_speedup" (relayed / group commit), the same five for "postgres_", each with its
"_spread" ([min, max]), "senders", "ranks", "ranks_per_node", "rounds"}.
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
RANKS_PER_NODE = 8


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


def node_envelopes(frames: list[bytes], ranks: int) -> list[bytes]:
    """Each node's frames of each flush as one envelope, as its agent's relay sends them
    (`frames` in flush order, ranks in order within one; `RANKS_PER_NODE` ranks a node)."""
    per = min(RANKS_PER_NODE, ranks)
    return [codec.encode_frames(frames[i : i + per]) for i in range(0, len(frames), per)]


class Senders:
    """`n` keep-alive clients posting frames concurrently; `post_all` returns when all are in.
    With `envelopes`, each body is a relay's envelope (every frame in it must be committed)."""

    def __init__(self, base: str, n: int, *, envelopes: bool = False) -> None:
        self.pool = ThreadPoolExecutor(max_workers=n)
        self.local = threading.local()
        self.base = base
        self.envelopes = envelopes

    def _post(self, frame: bytes) -> None:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = httpx.Client(base_url=self.base, timeout=120)
        if not self.envelopes:
            headers = {"content-type": api.BATCH_MEDIA_TYPE}
            client.post(api.INGEST_PATH, content=frame, headers=headers).raise_for_status()
            return
        headers = {"content-type": api.FRAMES_MEDIA_TYPE}
        response = client.post(api.INGEST_FRAMES_PATH, content=frame, headers=headers)
        response.raise_for_status()
        statuses = {r["status"] for r in response.json()["results"]}
        if statuses != {200}:
            raise RuntimeError(f"the collector refused relayed frames: {statuses}")

    def post_all(self, frames: list[bytes]) -> float:
        """Seconds until every frame was acknowledged."""
        t0 = time.perf_counter()
        for future in [self.pool.submit(self._post, f) for f in frames]:
            future.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


def one_round(
    urls: tuple[str, str, str],
    tmp: Path,
    frames: list[bytes],
    head: bytes,
    args: argparse.Namespace,
) -> tuple[float, float, float]:
    """Batches a second (group commit, one transaction each, relayed by nodes) over the same
    frames; the arms take turns chunk by chunk, in a rotating order."""
    cores = (0, 1) if (os.cpu_count() or 1) > 1 else (0, 0)
    one_each = {"VIGIL_INGEST_GROUP_COMMIT": "0"}
    per = min(RANKS_PER_NODE, args.ranks)
    nodes = -(-args.ranks // per)
    with (
        collector(urls[0], tmp, cores[0]) as grouped,
        collector(urls[1], tmp, cores[0], env=one_each) as alone,
        collector(urls[2], tmp, cores[0]) as relayed,
    ):
        os.sched_setaffinity(0, {cores[1]})
        arms = [
            Senders(grouped, args.senders),
            Senders(alone, args.senders),
            Senders(relayed, nodes, envelopes=True),
        ]
        try:
            for arm in arms:
                arm.post_all([head] if not arm.envelopes else [codec.encode_frames([head])])
            spent = [0.0, 0.0, 0.0]
            chunk = args.chunk - args.chunk % per or per  # whole flushes of whole nodes
            for k, first in enumerate(range(0, len(frames), chunk)):
                part = frames[first : first + chunk]
                bodies = [part, part, node_envelopes(part, args.ranks)]
                for i in (k % 3, (k + 1) % 3, (k + 2) % 3):
                    spent[i] += arms[i].post_all(bodies[i])
        finally:
            for arm in arms:
                arm.close()
    return len(frames) / spent[0], len(frames) / spent[1], len(frames) / spent[2]


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
                grouped, alone, relayed = [], [], []
                for r in range(args.rounds):
                    urls = tuple(
                        f"sqlite:///{tmp}/{store}-{r}-{arm}.sqlite3"
                        if store == "sqlite"
                        else pg.new_database()
                        for arm in ("grouped", "alone", "relayed")
                    )
                    g, a, n = one_round(urls, Path(tmp), frames, head, args)  # type: ignore[arg-type]
                    grouped.append(g)
                    alone.append(a)
                    relayed.append(n)
                    print(f"  {store} round {r}: group commit {g:,.0f} batches/s, one "
                          f"transaction each {a:,.0f} ({g / a:.2f}x), relayed by nodes "
                          f"{n:,.0f} ({n / g:.2f}x group commit)")  # fmt: skip
                arms = {"": grouped, "_one_each": alone, "_relayed": relayed}
                for suffix, values in arms.items():
                    med, lo, hi = median_spread(values)
                    figures[f"{store}_batches_per_s{suffix}"] = round(med)
                    figures[f"{store}_batches_per_s{suffix}_spread"] = [round(lo), round(hi)]
                for key, (num, den) in {
                    "group_commit_speedup": (grouped, alone),
                    "relay_speedup": (relayed, grouped),
                }.items():
                    x_med, x_lo, x_hi = median_spread(
                        [a / b for a, b in zip(num, den, strict=True)]
                    )
                    figures[f"{store}_{key}"] = round(x_med, 2)
                    figures[f"{store}_{key}_spread"] = [round(x_lo, 2), round(x_hi, 2)]
                print(
                    f"{store}: group commit {figures[f'{store}_batches_per_s']:,} batches/s, one "
                    f"each {figures[f'{store}_batches_per_s_one_each']:,}, relayed "
                    f"{figures[f'{store}_batches_per_s_relayed']:,}; group commit "
                    f"{figures[f'{store}_group_commit_speedup']}x "
                    f"{figures[f'{store}_group_commit_speedup_spread']}, relay "
                    f"{figures[f'{store}_relay_speedup']}x "
                    f"{figures[f'{store}_relay_speedup_spread']}"
                )
    finally:
        pg.stop()
    figures.update(
        senders=args.senders, ranks=args.ranks, ranks_per_node=RANKS_PER_NODE, rounds=args.rounds
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
