"""Writes the synthetic fixtures under data/ (from the root: python -m tests.analyzer.make_fixtures)

- jsonl_straggler/, jsonl_hang/: SDK-layout JSONL (`<job>/rank-NNNNN.jsonl`, one record per line)
  from the seeded simulator; jsonl_hang also carries one corrupt line.
- fr_nccl_hang/, fr_nccl_desync/: Flight Recorder dumps in torch's NCCL layout (pg_config with
  rank lists, entry states and timings), JSON and pickle. No GPU exists here, so these are built
  field by field after torch's NCCL writer rather than recorded; the gloo fixtures
  (make_gloo_dumps.py) are real recordings.
- fr_corrupt/: the real gloo pickle dumps with rank 0's truncated.
- kineto_corrupt/: a truncated gzip of a real Kineto trace.
"""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
from pathlib import Path

from tests.support import simulator as sim
from vigil import codec, schema

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]
SHARED = next(
    (
        p / "shared" / "testdata"
        for p in (ROOT.parent, *ROOT.parents)
        if (p / "shared" / "testdata").is_dir()
    ),
    ROOT.parent / "shared" / "testdata",
)


def write_jsonl(folder: Path, simulation: sim.Simulation, extra: list[schema.Record]) -> None:
    job_dir = folder / simulation.config.job_id
    shutil.rmtree(folder, ignore_errors=True)
    job_dir.mkdir(parents=True)
    by_rank: dict[int, list[bytes]] = {}
    for batch in simulation.records():
        for record in [*batch]:
            rank = getattr(record, "rank", 0)
            by_rank.setdefault(rank if isinstance(rank, int) and rank >= 0 else 0, []).append(
                codec.encode_json(record)
            )
    for record in extra:
        by_rank.setdefault(getattr(record, "rank", 0), []).append(codec.encode_json(record))
    for rank, lines in by_rank.items():
        (job_dir / f"rank-{rank:05d}.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def jsonl_fixtures() -> None:
    straggler = sim.simulate(
        sim.ScenarioConfig(
            job_id="train-straggler",
            num_ranks=8,
            num_steps=40,
            ranks_per_node=4,
            tp_collectives=0,
            faults=(
                sim.Fault(kind=sim.FaultKind.STRAGGLER, ranks=(5,), factor=1.3, start_step=10),
            ),
            seed=11,
        )
    )
    write_jsonl(DATA / "jsonl_straggler", straggler, [])
    hang = sim.simulate(
        sim.ScenarioConfig(
            job_id="train-hang",
            num_ranks=8,
            num_steps=40,
            ranks_per_node=4,
            tp_collectives=0,
            faults=(sim.Fault(kind=sim.FaultKind.HANG, rank=6, collective=0, start_step=25),),
            seed=12,
        )
    )
    assert hang.hang is not None
    beats = [b for t in range(1, 9) for b in hang.positions_at(hang.hang.onset_s + t)]
    write_jsonl(DATA / "jsonl_hang", hang, beats)
    with (DATA / "jsonl_hang" / "train-hang" / "rank-00000.jsonl").open("ab") as fh:
        fh.write(b'{"type": "step", "job_id": "train-hang", "rank": "zero"}\n')
    write_stacks(DATA / "jsonl_hang" / "stacks", culprit=6, ranks=8)


WAITING = [
    ("wait", "torch/distributed/distributed_c10d.py", 4501),
    ("all_reduce", "torch/distributed/distributed_c10d.py", 2501),
    ("train_step", "train.py", 88),
    ("main", "train.py", 120),
]
LOADING = [
    ("_recv_bytes", "multiprocessing/connection.py", 430),
    ("__next__", "torch/utils/data/dataloader.py", 631),
    ("train_step", "train.py", 80),
    ("main", "train.py", 120),
]


def write_stacks(folder: Path, *, culprit: int, ranks: int) -> None:
    """py-spy `dump` text for most ranks, faulthandler text for the last (both formats occur)."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        frames = LOADING if rank == culprit else WAITING
        if rank == ranks - 1:
            text = "Thread 0x00007f00aa (most recent call first):\n"
            text += '  File "threading.py", line 331 in wait\n\n'
            text += "Current thread 0x00007f00bb (most recent call first):\n"
            text += "".join(f'  File "{f}", line {n} in {fn}\n' for fn, f, n in frames)
        else:
            text = f"Process {4000 + rank}: python train.py\nPython v3.11.7 (/usr/bin/python3)\n\n"
            text += f'Thread {4000 + rank} (active): "MainThread"\n'
            text += "".join(f"    {fn} ({f}:{n})\n" for fn, f, n in frames)
            text += 'Thread 4100 (idle): "pin_memory"\n    wait (threading.py:331)\n'
        (folder / f"stacks-rank-{rank:05d}.txt").write_text(text)


def _entry(
    pg: tuple[str, str], pg_id: int, seq: int, op: str, state: str, t0: int
) -> dict[str, object]:
    done = state == "completed"
    return {
        "record_id": seq,
        "pg_id": pg_id,
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": t0,
        "duration_ms": 1.25 if done else None,
        "input_sizes": [[1024]],
        "input_dtypes": ["Float"],
        "output_sizes": [[1024]],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": t0 + 1000,
        "time_discovered_completed_ns": t0 + 2000 if done else None,
        "retired": done,
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [
            {"name": op, "filename": "torch/distributed/distributed_c10d.py", "line": 2500},
            {
                "name": "train_step",
                "filename": "train.py",
                "line": 88 if state != "completed" else 80,
            },
        ],
    }


def nccl_dump(rank: int, entries: list[dict[str, object]]) -> dict[str, object]:
    return {
        "version": "2.4",
        "comm_lib_version": "2.21.5",
        "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
            "1": {"name": "1", "desc": "tp", "ranks": "[0, 1]" if rank < 2 else "[2, 3]"},
        },
        "pg_status": {},
        "entries": entries,
    }


def nccl_fixtures() -> None:
    t0 = 1_795_000_000_000_000_000
    world, tp = ("0", "default_pg"), ("1", "tp")
    for scenario in ("fr_nccl_hang", "fr_nccl_desync"):
        shutil.rmtree(DATA / scenario, ignore_errors=True)
        for rank in range(4):
            entries = []
            for step in range(5):
                entries.append(
                    _entry(tp, 1, step + 1, "all_gather", "completed", t0 + step * 10**9)
                )
                op = (
                    "broadcast"
                    if scenario == "fr_nccl_desync" and rank == 2 and step == 4
                    else "all_reduce"
                )
                state = "started" if scenario == "fr_nccl_desync" and step == 4 else "completed"
                entries.append(_entry(world, 0, step + 1, op, state, t0 + step * 10**9 + 5 * 10**8))
            if scenario == "fr_nccl_hang" and rank != 1:  # rank 1 never reaches all_reduce #6
                entries.append(_entry(tp, 1, 6, "all_gather", "completed", t0 + 5 * 10**9))
                entries.append(_entry(world, 0, 6, "all_reduce", "started", t0 + 55 * 10**8))
            dump = nccl_dump(rank, entries)
            for kind in ("json", "pickle"):
                (DATA / scenario / kind).mkdir(parents=True, exist_ok=True)
            text = {
                **dump,
                "entries": [{k: v for k, v in e.items() if k != "frames"} for e in entries],
            }
            (DATA / scenario / "json" / f"nccl_trace_rank_{rank}.json").write_text(json.dumps(text))
            (DATA / scenario / "pickle" / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))


def corrupt_fixtures() -> None:
    folder = DATA / "fr_corrupt"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for rank in range(4):
        raw = (DATA / "fr_gloo_hang" / "pickle" / f"gloo_trace_rank_{rank}").read_bytes()
        (folder / f"gloo_trace_rank_{rank}").write_bytes(raw[: len(raw) // 2] if rank == 0 else raw)
    kineto = DATA / "kineto_corrupt"
    shutil.rmtree(kineto, ignore_errors=True)
    kineto.mkdir(parents=True)
    raw = (SHARED / "kineto" / "trace_filter_sampled_rank-1.json.gz").read_bytes()
    (kineto / "trace_filter_sampled_rank-1.json.gz").write_bytes(raw[:3000])
    assert gzip  # truncated on purpose: gzip reports an incomplete stream


if __name__ == "__main__":
    jsonl_fixtures()
    nccl_fixtures()
    corrupt_fixtures()
