"""What writing DDP's buckets to the progress page from the flusher saves the training thread.

    python bench/sdk_bucket_writes.py [--cycles 900]

One gloo process (world size 1) trains the bench/sdk_overhead.py model ("40ms" workload:
hidden 256, 4 layers, two gradient buckets a step): two bare DDP models and one watched by the
SDK. Each cycle runs four steps in shuffled order: the two bare models, and the watched one
twice, once with its buckets left for the flusher (`CollectiveRecorder.publish`, what the SDK
does) and once with each bucket written to the page at launch, on the training thread (what it
did before: the recorder's path for every other op, taken by marking the bucket's site not
overlapped for that step). Same model, same caches, alternating, so the difference per cycle is
the bucket writes' cost in place, free of the model-to-model differences that bound
sdk_overhead.py's resolution. Training-thread CPU (time.thread_time) per step; medians over
cycles with bootstrap 90 % intervals.

Last line: one JSON object: bucket_writes_saved_us (and _90), sdk_deferred_us and
sdk_at_launch_us (each less the mean of the cycle's two bare steps, and their _90), cpu_aa_us
(bare B less bare A: the method's own noise), buckets_per_step, cycles.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_report  # bench/overhead_report.py, beside this script
import sdk_overhead as so

import vigil.agent
from vigil import codec, schema
from vigil.agent import ddp_hook, sdk

KINDS = ("bare_a", "bare_b", "deferred", "at_launch")
LAYERS = 4  # sdk_overhead.py's default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=900)
    args = parser.parse_args()
    if args.cycles < 20:
        parser.error(f"--cycles must be >= 20, got {args.cycles}")
    torch.set_num_threads(1)
    store = dist.HashStore()  # one process: no rendezvous, no port
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    w = so.Workload.parse(so.DEFAULT_WORKLOADS[-1])  # "40ms"
    x = so._input(w)
    models = {k: torch.nn.parallel.DistributedDataParallel(so._model(w.hidden, LAYERS))
              for k in ("bare_a", "bare_b", "sdk")}  # fmt: skip
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    out = Path(tempfile.mkdtemp(prefix="vigil-bucket-writes-"))
    vigil.agent.init(job="bucket-writes", output_dir=out, progress_dir=out / "pages")
    session = sdk._session
    assert session is not None
    vigil.agent.watch(models["sdk"], opts["sdk"])
    recorder = session.recorder
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    order = list(KINDS)
    warm = 5
    for cycle in range(args.cycles + warm):
        random.shuffle(order)
        for kind in order:
            watched = kind in ("deferred", "at_launch")
            for site in recorder._sites.values():  # the buckets' site, from the first step on
                if site.op == ddp_hook.DDP_ALL_REDUCE:
                    site.overlapped = kind != "at_launch"
            name = "sdk" if watched else kind
            start = time.thread_time()
            with (vigil.agent.step(cycle, tokens=w.tokens) if watched
                  else so._no_sdk_step(cycle, tokens=0)) as s:  # fmt: skip
                so._train_step(models[name], opts[name], x, s)
            if cycle >= warm:
                cpu[kind].append(time.thread_time() - start)
    vigil.agent.shutdown()
    dist.destroy_process_group()
    records = (out / "bucket-writes" / "rank-00000.jsonl").read_bytes().splitlines()
    counts = [r.count for r in map(codec.decode_json, records)
              if isinstance(r, schema.CollectiveAggregate)]  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    c = {k: np.array(v) for k, v in cpu.items()}
    base = (c["bare_a"] + c["bare_b"]) / 2
    # One set of models throughout: cycles resampled alone.
    draws = overhead_report._set_draws(np.arange(base.size))
    interval = overhead_report._median_interval
    saved, saved_90 = interval(c["at_launch"] - c["deferred"], draws)
    deferred, deferred_90 = interval(c["deferred"] - base, draws)
    at_launch, at_launch_90 = interval(c["at_launch"] - base, draws)
    aa, aa_90 = interval(c["bare_b"] - c["bare_a"], draws)
    buckets = float(np.median(counts)) if counts else 0.0
    print(f"training-thread CPU per step, in place ({args.cycles} cycles; a bare step "
          f"{np.median(base) * 1e3:.2f} ms; {buckets:.1f} buckets a step):")  # fmt: skip
    print(
        f"  SDK, buckets written by the flusher:   {deferred:.0f} us "
        f"(90% interval {deferred_90[0]:.0f}-{deferred_90[1]:.0f}) beyond a bare step"
    )
    print(
        f"  SDK, buckets written at launch:        {at_launch:.0f} us "
        f"(90% interval {at_launch_90[0]:.0f}-{at_launch_90[1]:.0f})"
    )
    print(
        f"  saved by the flusher writing them (same model, paired): {saved:.0f} us a step "
        f"(90% interval {saved_90[0]:.0f}-{saved_90[1]:.0f})"
    )
    print(f"  A/A, bare B less bare A: {aa:.0f} us (90% interval {aa_90[0]:.0f}-{aa_90[1]:.0f})")

    def r(v: float) -> float:
        return round(v, 1)

    print(json.dumps({
        "bucket_writes_saved_us": r(saved), "bucket_writes_saved_us_90": list(map(r, saved_90)),
        "sdk_deferred_us": r(deferred), "sdk_deferred_us_90": list(map(r, deferred_90)),
        "sdk_at_launch_us": r(at_launch), "sdk_at_launch_us_90": list(map(r, at_launch_90)),
        "cpu_aa_us": r(aa), "buckets_per_step": round(buckets, 2), "cycles": args.cycles,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
