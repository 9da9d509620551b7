"""Per-step snapshots against training speed: the bundled trainer's 125m recipe and a user's loop.

Two gloo ranks on CPU, each its own simulated node (so every snapshot is also replicated to the
peer), run rounds of a few steps alternately without and with a snapshot after every step:
  - trainer: `vigil.trainer`'s Trainer, recipe 125m (FSDP2 over the 2 ranks, fp32, short
    sequences so a CPU step stays near a second), snapshots through VIGIL_SNAPSHOT_DIR as under
    `vigil run`;
  - user: a plain DDP loop (an MLP of ~25M parameters, AdamW) with `vigil.agent.snapshots`.
Per round it records the step time (wall time between step ends, so the snapshot's own cost
counts), the snapshots' training-thread stall (`SnapshotStats.stall_s_total`: reading the state
dicts, staging, the agreement all-reduce past the last rank's arrival — the trainer carries that
flag in its own per-step all-reduce instead — and any wait of the next optimizer step for the
copies) per snapshot taken, the time spent in the agreement waiting for the other rank (reported
beside it: the next gradient all-reduce would wait for that rank anyway),
the interval achieved (steps / snapshots written), and the stall of a synchronous `torch.save`
of the same state into /dev/shm (what a blocking snapshot costs at the least). Figures are
medians over rounds and ranks with min-max; the last line is one JSON object with
`stall_ratio_to_sync_save`, `step_time_ratio` and `snapshot_every_steps` (the trainer's), the
user loop's beside them. Target: stall <= 10 % of the synchronous save's.

    python bench/snapshot.py [--rounds 1 --steps 4 --user-rounds 2 --user-steps 8]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----- the ranks ---------------------------------------------------------------------------
def trainer_round(snap_root: Path | None, job: str, steps: int) -> tuple[list[float], Any]:
    import torch.distributed as dist

    from vigil.env import EnvVar
    from vigil.trainer import loop, recipes

    recipe = recipes.named(
        "125m", steps=steps, seq_len=32, global_batch=2, compile=False,
        precision=recipes.Precision.FP32,
        activation_checkpoint=recipes.ActivationCheckpoint.NONE,
        parallel=recipes.ParallelConfig(dp=2),
    )  # fmt: skip
    if snap_root is not None:
        os.environ[EnvVar.SNAPSHOT_DIR] = str(snap_root)
    else:
        os.environ.pop(EnvVar.SNAPSHOT_DIR, None)
    ctx = loop.RunContext(rank=dist.get_rank(), world_size=dist.get_world_size(), job_id=job)
    trainer = loop.Trainer(recipe, ctx=ctx)
    result = trainer.train()
    trainer.snaps.flush()
    ends = [s.end_s for s in result.history]
    sync = sync_save(trainer.snaps, snap_root) if snap_root is not None else None
    stats = trainer.snaps.stats
    trainer.close()
    return [b - a for a, b in itertools.pairwise(ends)], (stats, sync)


def user_round(snap_root: Path | None, job: str, steps: int) -> tuple[list[float], Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import vigil.agent

    torch.manual_seed(0)
    width = 1024
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(24)])
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    snaps = vigil.agent.snapshots(model, optimizer, job=job, root=snap_root) if snap_root else None
    ends = []
    for step in range(steps):
        x = torch.randn(32, width)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if snaps is not None:
            snaps.save(step)
        ends.append(time.time())
    if snaps is None:
        return [b - a for a, b in itertools.pairwise(ends)], None
    snaps.flush()
    sync = sync_save(snaps, snap_root)
    stats = snaps.stats
    snaps.close()
    return [b - a for a, b in itertools.pairwise(ends)], (stats, sync)


def sync_save(snaps: Any, root: Path | None) -> float:
    """Seconds a blocking torch.save of the same state into node shared memory takes."""
    import torch

    assert root is not None
    path = root / f"sync-{os.getpid()}.pt"
    times = []
    for _ in range(2):
        started = time.perf_counter()
        torch.save(snaps.state(), path)
        times.append(time.perf_counter() - started)
        path.unlink()
    return min(times)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from vigil.recovery import snapshot_files

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    rows = []
    plan = (("trainer", trainer_round, args.rounds, args.steps),
            ("user", user_round, args.user_rounds, args.user_steps))  # fmt: skip
    for kind, run, rounds, steps in plan:
        for index in range(rounds):
            for snapshots in (False, True):
                job = f"bench-snap-{kind}-{index}-{int(snapshots)}"
                root = args.root if snapshots else None
                dist.barrier()
                gaps, extra = run(root, job, steps)
                row: dict[str, Any] = {"kind": kind, "snapshots": snapshots, "rank": rank,
                                       "step_s": statistics.median(gaps)}  # fmt: skip
                if extra is not None:
                    stats, sync = extra
                    row.update(stall_s=stats.stall_s_total / max(1, stats.num_saved),
                               every=steps / max(1, stats.num_saved), sync_s=sync,
                               bytes=stats.bytes_last, skipped=stats.num_skipped,
                               agree_s=stats.agree_s_total / max(1, stats.num_saved),
                               wait_s=stats.wait_s_total / max(1, stats.num_saved),
                               skew_s=stats.skew_s_total / max(1, stats.num_saved))  # fmt: skip
                rows.append(row)
                dist.barrier()
                if rank == 0 and snapshots:
                    snapshot_files.drop_job(args.root, job)
    with open(args.out / f"rank-{rank}.json", "w") as fh:
        json.dump(rows, fh)
    dist.destroy_process_group()


# ----- the launcher and the report ---------------------------------------------------------
def launch(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "VIGIL_NODE": f"node-{rank}", "VIGIL_JOB": "bench-snapshot"}  # fmt: skip
        argv = [sys.executable, __file__, "--worker", "--out", str(work),
                "--root", str(work / "shm"), "--rounds", str(args.rounds),
                "--steps", str(args.steps), "--user-rounds", str(args.user_rounds),
                "--user-steps", str(args.user_steps)]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise SystemExit(f"bench ranks failed: exit codes {codes}")
    return [row for r in range(2) for row in json.loads((work / f"rank-{r}.json").read_text())]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    on = [r for r in rows if r["kind"] == kind and r["snapshots"]]
    off = [r for r in rows if r["kind"] == kind and not r["snapshots"]]
    ratios = [a["step_s"] / b["step_s"] for a, b in zip(on, off, strict=True)]  # same round, rank
    stall = [r["stall_s"] / r["sync_s"] for r in on]
    return {
        "step_s_off": spread([r["step_s"] for r in off]),
        "step_s_on": spread([r["step_s"] for r in on]),
        "step_time_ratio": spread(ratios),
        "stall_s": spread([r["stall_s"] for r in on]),
        "agree_s": spread([r["agree_s"] for r in on]),
        "wait_s": spread([r["wait_s"] for r in on]),
        "skew_s": spread([r["skew_s"] for r in on]),
        "sync_save_s": spread([r["sync_s"] for r in on]),
        "stall_ratio_to_sync_save": spread(stall),
        "snapshot_every_steps": spread([r["every"] for r in on]),
        "snapshot_mb": on[0]["bytes"] / 1e6,
    }


def report(name: str, s: dict[str, Any]) -> None:
    def cell(key: str, unit: str = "", scale: float = 1.0) -> str:
        v = s[key]
        return f"{v['median'] * scale:.3g}{unit} ({v['min'] * scale:.3g}-{v['max'] * scale:.3g})"

    print(
        f"{name}: {s['snapshot_mb']:.0f} MB per rank per snapshot; step {cell('step_s_off', ' s')} "
        f"without, {cell('step_s_on', ' s')} with snapshots (ratio {cell('step_time_ratio')}); "
        f"training-thread stall {cell('stall_s', ' ms', 1e3)} per snapshot (of it the agreement "
        f"{cell('agree_s', ' ms', 1e3)}, copy waits {cell('wait_s', ' ms', 1e3)}; not in it: "
        f"waiting there for the other rank {cell('skew_s', ' ms', 1e3)}) vs a synchronous "
        f"torch.save {cell('sync_save_s', ' ms', 1e3)} (ratio {cell('stall_ratio_to_sync_save')}, "
        f"target <= 0.1); one snapshot every {cell('snapshot_every_steps')} steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1, help="trainer rounds each way")
    parser.add_argument("--steps", type=int, default=4, help="trainer steps per round")
    parser.add_argument("--user-rounds", type=int, default=2, help="user-loop rounds each way")
    parser.add_argument("--user-steps", type=int, default=8, help="user-loop steps per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if min(args.rounds, args.user_rounds) < 1 or min(args.steps, args.user_steps) < 3:
        parser.error("rounds must be >= 1 and steps >= 3")
    work = Path(tempfile.mkdtemp(prefix="vigil-bench-snapshot-", dir=ROOT_DIR))
    try:
        started = time.monotonic()
        rows = launch(args, work)
        elapsed = time.monotonic() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    trainer, user = summarise(rows, "trainer"), summarise(rows, "user")
    print(
        f"2 gloo ranks on 2 simulated nodes, CPU; trainer {args.rounds} x {args.steps} steps, "
        f"user loop {args.user_rounds} x {args.user_steps} steps each way; {elapsed:.0f} s"
    )
    report("trainer 125m (FSDP2)", trainer)
    report("user DDP loop", user)
    out: dict[str, Any] = {
        "stall_ratio_to_sync_save": round(trainer["stall_ratio_to_sync_save"]["median"], 4),
        "step_time_ratio": round(trainer["step_time_ratio"]["median"], 3),
        "snapshot_every_steps": round(trainer["snapshot_every_steps"]["median"], 2),
    }
    for prefix, s in (("", trainer), ("user_", user)):
        for key in ("stall_ratio_to_sync_save", "step_time_ratio", "snapshot_every_steps"):
            if prefix:
                out[f"{prefix}{key}"] = round(s[key]["median"], 4)
            out[f"{prefix}{key}_min"] = round(s[key]["min"], 4)
            out[f"{prefix}{key}_max"] = round(s[key]["max"], 4)
        out[f"{prefix}stall_ms"] = round(s["stall_s"]["median"] * 1e3, 2)
        out[f"{prefix}agree_ms"] = round(s["agree_s"]["median"] * 1e3, 2)
        out[f"{prefix}copy_wait_ms"] = round(s["wait_s"]["median"] * 1e3, 2)
        out[f"{prefix}rank_skew_ms"] = round(s["skew_s"]["median"] * 1e3, 2)
        out[f"{prefix}sync_save_ms"] = round(s["sync_save_s"]["median"] * 1e3, 2)
        out[f"{prefix}snapshot_mb"] = round(s["snapshot_mb"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
