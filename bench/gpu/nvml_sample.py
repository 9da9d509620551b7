"""The node agent's NVML sampler on this machine's GPUs for a few seconds, under a GEMM load.

Runs `vigil.agent.sampler.NvmlSampler` as the agent does (one `sample()` a second) while this
process keeps cuda:0 busy with bf16 matmuls, then prints, per GPU and field the sampler claims,
the range it read (or that the board left it out), the XID events it counted, and whether
`owners` attributed cuda:0 to this process (NVML's process list holds host pids, so a container
without the host's pid namespace attributes nothing). For bench/gpu/run.sh; the last line is
one JSON object: {"nvml_samples", "nvml_fields_reported", "nvml_fields_missing",
"nvml_xid_events", "nvml_owner_found", "nvml_sm_clock_mhz_max", "nvml_power_w_max",
"nvml_utilization_max"} (fields on the first GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import defaultdict

import torch

from vigil.agent import sampler

# Every field NvmlSampler._device claims, in its order.
CLAIMED = (
    "utilization",
    "sm_clock",
    "memory_clock",
    "memory_used",
    "power",
    "temperature",
    "throttle_reasons",
    "ecc_uncorrected_errors",
    "ecc_corrected_errors",
    "pcie_receive",
    "pcie_transmit",
    "xid_events",
)


def gemm_load(stop: threading.Event) -> None:
    """bf16 matmuls on cuda:0 until `stop`, so utilisation, clocks and power move."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(4):
            a @ b
        torch.cuda.synchronize()


def sample(gpus: sampler.NvmlSampler, seconds: float) -> tuple[list[list[sampler.Reading]], bool]:
    """One `sample()` a second for `seconds` under load; whether this process was an owner."""
    me = {os.getpid(): sampler.Owner(job="bench-gpu", rank=0)}
    stop = threading.Event()
    load = threading.Thread(target=gemm_load, args=(stop,), daemon=True)
    load.start()
    rounds, owned = [], False
    try:
        time.sleep(1.0)  # the load is running before the first sample
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            rounds.append(gpus.sample())
            owned = owned or bool(gpus.owners(me))
            time.sleep(1.0)
    finally:
        stop.set()
        load.join(timeout=30)
    return rounds, owned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    gpus = sampler.open_nvml(enabled=True)
    if gpus is None or not torch.cuda.is_available():
        print("no NVML or no CUDA device: nothing sampled")
        print(json.dumps({"nvml_samples": 0, "nvml_fields_reported": 0}))
        raise SystemExit(1)
    try:
        rounds, owned = sample(gpus, args.seconds)
        xid = gpus.xid_counts
    finally:
        gpus.close()
    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    metrics: dict[str, str] = {}
    for readings in rounds:
        for r in readings:
            values[(r.device, r.name)].append(r.value)
            metrics[r.name] = r.metric
    devices = sorted({device for device, _ in values})
    print(f"{len(rounds)} samples, 1 s apart, under a bf16 GEMM load on cuda:0")
    for device in devices:
        print(f"GPU {device}:")
        for name in CLAIMED:
            seen = values.get((device, name))
            if seen is None:
                print(f"  {name:<24} not reported (the board or driver lacks it)")
            else:
                print(f"  {metrics[name]:<44} {min(seen):.6g} .. {max(seen):.6g} ({len(seen)})")
    first = devices[0] if devices else ""
    reported = [n for n in CLAIMED if (first, n) in values]
    print(f"XID events counted per GPU: {xid} (a log line says when the board cannot report them)")
    print(f"owner attribution of cuda:0 to this process: {'yes' if owned else 'no'}")

    def top(name: str, scale: float = 1.0) -> float:
        return round(max(values.get((first, name), [0.0])) * scale, 3)

    print(
        json.dumps(
            {
                "nvml_samples": len(rounds),
                "nvml_fields_reported": len(reported),
                "nvml_fields_missing": [n for n in CLAIMED if n not in reported],
                "nvml_xid_events": int(sum(xid)),
                "nvml_owner_found": int(owned),
                "nvml_sm_clock_mhz_max": top("sm_clock", 1e-6),
                "nvml_power_w_max": top("power"),
                "nvml_utilization_max": top("utilization"),
            }
        )
    )


if __name__ == "__main__":
    main()
