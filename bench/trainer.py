"""Trainer throughput and MFU per parallel layout, measured side by side in one run.

On CPU: every layout trains the same small model through `vigil train` (real gloo ranks on this
host); tokens/s is the global batch's tokens over the median steady-state step time, and MFU is
the model FLOP/s (6N + 12·L·H·Q·T per token, PaLM appendix B) over this host's measured fp32 GEMM
peak (cores x one core's best; each rank runs one thread, and 4-rank layouts share 2 cores).
On a CUDA host it also trains the ~1B recipe on one GPU in bf16 and reports MFU against the
datasheet peak (`vigil.trainer.runtime.GPU_PEAK_BF16`).

Layouts run in `--rounds` interleaved rounds (ABC ABC, so load changes hit every layout
alike); each layout's figure is the median over rounds, printed with its spread (min-max).

Last line: one JSON object with `<layout>_tokens_per_s` and `<layout>_mfu` (medians) and
`<layout>_tokens_per_s_spread` ([min, max]) for each layout run, `rounds`, and on a CUDA host
`gpu_1b_tokens_per_s` and `gpu_1b_mfu`.
Usage: python bench/trainer.py [--steps 8] [--layouts single,ddp,...] [--rounds 3]
       [--gpu-steps 30] [--gpu-only]   (--gpu-only: the ~1B recipe alone, bench/gpu/run.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vigil.trainer import launch, recipes

# The CPU model: big enough that GEMMs dominate, small enough for 4 ranks on 2 cores.
CPU_MODEL = ["--dim", "256", "--layers", "4", "--heads", "8", "--seq-len", "128"]
CPU_BATCH = ["--global-batch", "8"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "ddp": (2, ["--dp", "2", "--dp-mode", "ddp"]),
    "fsdp": (2, ["--dp", "2"]),
    "tp": (2, ["--tp", "2"]),
    "pp": (2, ["--pp", "2", "--pp-schedule", "1f1b"]),
    "dp_tp": (4, ["--dp", "2", "--tp", "2"]),
    "dp_pp": (4, ["--dp", "2", "--pp", "2"]),
}
WARMUP_STEPS = 2  # first steps pay for allocation, autograd graph building, FSDP lazy init


def cpu_gemm_peak(sizes: tuple[int, ...] = (256, 512, 1024), repeats: int = 30) -> float:
    """fp32 matmul FLOP/s of this host: one core's best, times the number of cores.

    Measured on one thread (as the ranks run) and the best over sizes and repeats: on a shared
    host most samples are slowed by other load, and the peak is what the hardware can do.
    """
    torch.set_num_threads(1)
    best = 0.0
    for size in sizes:
        a, b = torch.randn(size, size), torch.randn(size, size)
        for _ in range(3):
            a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best * (os.cpu_count() or 1)


def flops_per_token() -> float:
    model = recipes.ModelConfig(dim=256, n_layers=4, n_heads=8, max_seq_len=128)
    return model.flops_per_token(128)


def run_layout(name: str, nproc: int, extra: list[str], steps: int, out: Path) -> float:
    """Median steady-state tokens/s of one layout, from rank 0's per-step metrics."""
    metrics = out / f"{name}.jsonl"
    args = [*CPU_MODEL, *CPU_BATCH, "--steps", str(steps), "--no-telemetry", "--cpu"]
    args += ["--cpu-threads", "1"]  # one core per rank: no OpenMP spin-waiting on a shared host
    args += ["--metrics-out", str(metrics), *extra]
    code = launch.launch_local(nproc, args, timeout_s=600)
    if code != 0:
        raise RuntimeError(f"layout {name} exited with {code}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_s = statistics.median(r["step_s"] for r in rows[WARMUP_STEPS:])
    return 8 * 128 / step_s


def gpu_1b(steps: int) -> dict[str, float]:
    """The ~1B recipe on one GPU, bf16, compiled: tokens/s and MFU against the table peak."""
    from vigil.trainer import loop, runtime

    device = torch.device("cuda", 0)
    peak = runtime.peak_flops_for(device)
    recipe = recipes.named("1b", steps=steps)
    ctx = loop.RunContext(device=device, peak_flops=peak)
    with loop.trainer_session(recipe, ctx=ctx) as trainer:
        result = trainer.train()
    tail = result.history[max(WARMUP_STEPS, 5) :]
    tokens_per_s = recipe.tokens_per_step / statistics.median(s.step_s for s in tail)
    mfu = tokens_per_s * recipe.model.flops_per_token(recipe.seq_len) / peak if peak else 0.0
    print(
        f"gpu 1b ({torch.cuda.get_device_name(device)}): {tokens_per_s:,.0f} tok/s, MFU {mfu:.1%}"
    )
    return {"gpu_1b_tokens_per_s": round(tokens_per_s, 1), "gpu_1b_mfu": round(mfu, 4)}


def cpu_layouts(names: list[str], steps: int, rounds: int) -> tuple[float, dict[str, list[float]]]:
    """The host's GEMM peak and each layout's tokens/s in each round."""
    peak, rates = 0.0, {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="vigil-bench-") as tmp:
        for round_index in range(rounds):  # ABC ABC: load changes hit every layout alike
            peak = max(peak, cpu_gemm_peak())
            for name in names:
                nproc, extra = LAYOUTS[name]
                out = Path(tmp) / f"round-{round_index}"
                out.mkdir(exist_ok=True)
                rates[name].append(run_layout(name, nproc, extra, steps, out))
    return peak, rates


def report_cpu(names: list[str], args: argparse.Namespace) -> dict[str, object]:
    fpt = flops_per_token()
    peak, rates = cpu_layouts(names, args.steps, args.rounds)
    cores = os.cpu_count() or 1
    print(
        f"CPU fp32 GEMM peak: {peak / 1e9:.1f} GFLOP/s ({cores} cores x best 1-thread "
        "256..1024^3 matmul); ranks run 1 thread each, so 1 rank can reach 1/cores of it"
    )
    print(
        f"model: dim 256, 4 layers, 8 heads, seq 128, batch 8; {fpt / 1e6:.1f} MFLOP/token; "
        f"median of {args.rounds} interleaved rounds of {args.steps} steps (min-max beside)"
    )
    result: dict[str, object] = {}
    base = statistics.median(rates[names[0]])
    print(
        f"{'layout':<8} {'ranks':>5} {'tokens/s':>10} {'min-max':>15} "
        f"{'vs ' + names[0]:>10} {'MFU':>7}"
    )
    for name in names:
        tokens_per_s = statistics.median(rates[name])
        low, high = min(rates[name]), max(rates[name])
        mfu = tokens_per_s * fpt / peak
        result[f"{name}_tokens_per_s"] = round(tokens_per_s, 1)
        result[f"{name}_mfu"] = round(mfu, 4)
        result[f"{name}_tokens_per_s_spread"] = [round(low, 1), round(high, 1)]
        print(
            f"{name:<8} {LAYOUTS[name][0]:>5} {tokens_per_s:>10,.0f} "
            f"{f'{low:,.0f}-{high:,.0f}':>15} {tokens_per_s / base:>9.2f}x {mfu:>7.1%}"
        )
    result["rounds"] = args.rounds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--gpu-steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; median kept")
    parser.add_argument("--gpu-only", action="store_true", help="only the ~1B recipe on cuda:0")
    args = parser.parse_args()
    os.environ.setdefault("VIGIL_LOG_LEVEL", "WARNING")  # the ranks' per-step lines
    result = {} if args.gpu_only else report_cpu(args.layouts.split(","), args)
    if torch.cuda.is_available():
        result.update(gpu_1b(args.gpu_steps))
    else:
        print("no CUDA device: the GPU ~1B recipe (bf16, one H200, >= 35% MFU expected) not run")
    print(json.dumps(result))
    if args.gpu_only and not torch.cuda.is_available():
        raise SystemExit(1)  # asked for the GPU figure alone, and it could not be measured


if __name__ == "__main__":
    main()
