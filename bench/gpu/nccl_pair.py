"""Two NCCL processes on one GPU: whether NCCL allows it, and if so a two-member group's
all-reduce (result, bus bandwidth) and the SDK's CUDA-event timing across real members.

Both processes use cuda:0 (NCCL refuses two ranks of one communicator on one device in many
versions: "Duplicate GPU detected"; then this says so and stops). The timing check: the SDK
(`vigil.agent` patching, a `CollectiveRecorder`) times each all-reduce from a launch event to an
end event on the op's device. Rank 1 first delays its stream on the device by a known time
(`torch.cuda._sleep`, calibrated with CUDA events) before each all-reduce; rank 0 does not. Rank
0's kernel waits inside the collective for rank 1, so its measured device time must grow by the
delay over the same op undelayed, and rank 1's (its launch event follows its own sleep) must
not. For bench/gpu/run.sh; the last line is one JSON object: {"nccl_pair" ("ok", "refused",
"failed", "timeout" or "no CUDA"), "nccl_pair_error", "nccl_pair_busbw_gb_s",
"nccl_pair_delay_ms", "nccl_pair_rank0_extra_ms", "nccl_pair_rank1_extra_ms",
"nccl_pair_timing_ok"}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.append(str(Path(__file__).resolve().parents[2]))  # `tests` when not run by run.sh

from tests.realjobs.train import Spinner  # the real-job script's calibrated device spin
from vigil.agent import collectives as sdk_collectives
from vigil.agent import patching
from vigil.kernels import collectives

WORLD = 2
REPS = 5


def cycles_per_ms() -> float:
    """GPU clock cycles `torch.cuda._sleep` spins per millisecond on the current device."""
    device = torch.device("cuda", torch.cuda.current_device())
    return Spinner(device).cycles_per_s / 1000.0


def timed_all_reduces(
    x: torch.Tensor, host: Any, delay_cycles: int, reps: int, recorder: Any
) -> float:
    """Mean SDK-measured device time (ms) of `reps` all-reduces of `x`, each started together
    (host barrier) after this rank's stream slept `delay_cycles`."""
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier(group=host)
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)
        dist.all_reduce(x, async_op=True).wait()
    torch.cuda.synchronize()
    aggs, _, _ = recorder.swap()
    timed = [agg for site, agg in aggs.items() if site.op == "all_reduce" and agg.count == reps]
    if len(timed) != 1:
        raise RuntimeError(f"expected one timed all_reduce site, got {len(timed)}")
    return timed[0].total_s / timed[0].count * 1000.0


def timing_check(rank: int, host: Any, delay_ms: float) -> dict[str, float]:
    """Each rank's device time of an all-reduce without and with rank 1 delayed."""
    x = torch.ones(4 << 20, device="cuda")
    delay_cycles = int(delay_ms * cycles_per_ms()) if rank == 1 else 0
    errors: list[BaseException] = []
    recorder = sdk_collectives.CollectiveRecorder(page=None, on_error=errors.append)
    patching.install(recorder)
    try:
        base = timed_all_reduces(x, host, 0, REPS, recorder)
        delayed = timed_all_reduces(x, host, delay_cycles, REPS, recorder)
    finally:
        patching.uninstall()
    if errors:
        raise RuntimeError(f"the SDK recorded errors: {errors[:3]}")
    return {"base_ms": base, "delayed_ms": delayed}


def worker(rank: int, store_path: str, delay_ms: float, results: Any) -> None:
    try:
        device = torch.device("cuda", 0)  # both ranks on the one GPU
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            store=dist.FileStore(store_path, WORLD),  # type: ignore[attr-defined]
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=30),
            device_id=device,  # eager: a refusal shows here, not at the first op
        )
        try:
            host = dist.new_group(backend="gloo")
            x = torch.full((1 << 20,), float(rank + 1), device=device)
            dist.all_reduce(x)
            correct = bool(torch.all(x == 3.0).item())
            config = collectives.CollectiveConfig(
                sizes=(64 << 20,), ops=("all_reduce",), warmup=2, iters=5, timeout_s=30.0
            )
            (figure,) = collectives.measure(config, device)
            timing = timing_check(rank, host, delay_ms)
            gathered: list[Any] = [None] * WORLD
            dist.all_gather_object(gathered, timing, group=host)
            if rank == 0:
                results.put(("ok", {"correct": correct, "busbw": figure.busbw_gb_s, "t": gathered}))
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # reported to the parent
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def run_pair(delay_ms: float, timeout_s: float) -> tuple[str, Any]:
    ctx = mp.get_context("spawn")
    results: Any = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="vigil-nccl-pair-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=worker, args=(rank, store, delay_ms, results), daemon=True)
            for rank in range(WORLD)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        outcome: tuple[str, Any] = ("timeout", f"no result within {timeout_s:.0f} s")
        while time.monotonic() < deadline:
            if not results.empty():
                outcome = results.get()
                break
            if all(p.exitcode is not None for p in procs):
                outcome = results.get() if not results.empty() else ("error", "workers exited")
                break
            time.sleep(0.1)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole pair")
    args = parser.parse_args()
    summary: dict[str, Any] = {"nccl_pair": "no CUDA", "nccl_pair_delay_ms": args.delay_ms}
    if not torch.cuda.is_available():
        print("no CUDA device: the two-process NCCL run needs one")
        print(json.dumps(summary))
        raise SystemExit(1)
    kind, payload = run_pair(args.delay_ms, args.timeout)
    if kind != "ok":
        refused = "Duplicate GPU" in str(payload) or "ncclInvalidUsage" in str(payload)
        summary.update(nccl_pair="refused" if refused else kind, nccl_pair_error=str(payload))
        why = "NCCL refuses two ranks on one GPU" if refused else "the pair did not complete"
        print(f"two NCCL processes on cuda:0: {why}: {payload}")
        print(json.dumps(summary))
        return
    r0, r1 = payload["t"]
    extra0, extra1 = r0["delayed_ms"] - r0["base_ms"], r1["delayed_ms"] - r1["base_ms"]
    timing_ok = extra0 >= 0.9 * args.delay_ms and extra1 < 0.5 * args.delay_ms
    print(
        f"two NCCL processes on cuda:0: all-reduce {'correct' if payload['correct'] else 'WRONG'}"
        f", 64 MiB busbw {payload['busbw']:.1f} GB/s (two contexts sharing one GPU)"
    )
    for rank, t in enumerate(payload["t"]):
        print(
            f"  rank {rank}: SDK device time of a 16 MiB all-reduce {t['base_ms']:.2f} ms, "
            f"with rank 1 delayed {args.delay_ms:g} ms: {t['delayed_ms']:.2f} ms"
        )
    print(
        f"  rank 0 waited {extra0:.1f} ms more (>= {0.9 * args.delay_ms:g} expected), rank 1 "
        f"{extra1:.1f} ms (< {0.5 * args.delay_ms:g}): {'ok' if timing_ok else 'WRONG'}"
    )
    summary.update(
        nccl_pair="ok" if payload["correct"] else "wrong result",
        nccl_pair_busbw_gb_s=round(payload["busbw"], 2),
        nccl_pair_rank0_extra_ms=round(extra0, 2),
        nccl_pair_rank1_extra_ms=round(extra1, 2),
        nccl_pair_timing_ok=int(timing_ok),
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
