"""Side-by-side figures of vigil's diagnostic kernels against torch, on one device.

Measured in one run, on the same operands:
  - GEMM: vigil's Triton matmul vs torch.matmul (cuBLAS) in TFLOP/s, with their agreement;
  - memory bandwidth: Triton copy/scale/add/triad vs torch (copy = device-to-device copy_);
  - memory test: coverage of free memory and effective bandwidth of the integrity passes;
  - host<->device copies, the SDC check and (GPU) a short clock/thermal burn.
The last line of output is one JSON object with exactly the keys
{"gemm_ratio_to_torch", "copy_ratio_to_torch", "memtest_coverage", "memtest_tb_per_s",
 "gpu_tests_passed", "gpu_tests_failed"}; the gpu test counts are passed in by the caller
(bench/gpu/run.sh runs `pytest -m gpu` first). bench/diag_cpu.py runs this on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vigil.kernels import bandwidth, devices, gemm, memtest, sdc, thermal


def _line(label: str, value: str) -> None:
    print(f"{label:<44} {value}", flush=True)


def _gemm(target: devices.Target, size: int, dtypes: tuple[str, ...], iters: int) -> float | None:
    config = gemm.GemmConfig(size=size, dtypes=dtypes, warmup=2, iters=iters, interpret_on_cpu=True)
    ratio = None
    for f in gemm.run(target, config):
        triton = "n/a" if f.triton_tflops is None else f"{f.triton_tflops:9.4g}"
        _line(
            f"GEMM {f.dtype} {size}^3 TFLOP/s",
            f"triton[{f.triton_variant or '-'}] {triton}  torch {f.torch_tflops:9.4g}  "
            f"ratio {f.ratio_to_torch or 0:.4g}  "
            f"rel.err {f.rel_error if f.rel_error is not None else float('nan'):.1e} "
            f"({'agrees' if f.agrees else 'DISAGREES'})",
        )
        if ratio is None:
            ratio = f.ratio_to_torch
    return ratio


def _stream(target: devices.Target, nbytes: int, iters: int) -> float | None:
    config = bandwidth.BandwidthConfig(
        stream_bytes=nbytes, host_bytes=nbytes, warmup=2, iters=iters, interpret_on_cpu=True
    )
    copy_ratio = None
    for f in bandwidth.run_stream(target, config):
        triton = "n/a" if f.triton_gb_s is None else f"{f.triton_gb_s:9.4g}"
        _line(
            f"STREAM {f.op} {nbytes >> 20} MiB/array GB/s",
            f"triton {triton}  torch {f.torch_gb_s:9.4g}  ratio {f.ratio_to_torch or 0:.4g}  "
            f"wrong {f.wrong_elements}",
        )
        if f.op == "copy":
            copy_ratio = f.ratio_to_torch
    host = bandwidth.run_host(target, config)
    kind = "host->host (no GPU)" if host.host_only else "pinned"
    _line(f"H2D / D2H GB/s ({kind})", f"{host.h2d_gb_s:.1f} / {host.d2h_gb_s:.1f}")
    return copy_ratio


def _memtest(target: devices.Target, full: bool, cpu_bytes: int) -> memtest.MemtestOutcome:
    config = memtest.MemtestConfig(
        cpu_bytes=cpu_bytes,
        patterns=memtest.FULL_PATTERNS if full else memtest.QUICK_PATTERNS,
        walking_bits=memtest.QUICK_WALKING_BITS,
    )
    outcome = memtest.run(target, config)
    _line(
        "memtest coverage / effective TB/s",
        f"{outcome.coverage:.3f} of {outcome.free_bytes / 2**30:.1f} GiB free / "
        f"{outcome.tb_per_s:.4g} TB/s over {outcome.seconds:.2f} s",
    )
    _line("memtest failing words", f"{outcome.failing_words} ({len(outcome.passes)} passes)")
    return outcome


def _sdc(target: devices.Target, size: int, hash_elements: int) -> None:
    start = time.perf_counter()
    outcome = sdc.run(target, sdc.SdcConfig(size=size, rounds=4, hash_elements=hash_elements))
    _line(
        f"SDC {size}^3 x4 rounds + {hash_elements} mixed words",
        f"mismatches {outcome.mismatches}  checksum {outcome.checksum:#x} "
        f"({'= reference' if outcome.checksum == outcome.expected else 'DIFFERS'}) "
        f"in {time.perf_counter() - start:.2f} s",
    )


def _burn(target: devices.Target, seconds: float, size: int) -> None:
    config = thermal.BurnConfig(duration_s=seconds, interval_s=1.0, size=size, dtype="bf16")
    outcome = thermal.burn(target, config, thermal.sampler_for(target))
    clocks = [s.sm_mhz for s in outcome.samples if s.sm_mhz]
    temps = [s.temperature_c for s in outcome.samples if s.temperature_c]
    reasons = sorted(set().union(*(s.reasons for s in outcome.samples)))
    _line(
        f"burn {seconds:.0f} s TFLOP/s median / stability",
        f"{outcome.median_tflops:.1f} / {outcome.throughput_stability:.3f}",
    )
    _line(
        "burn SM clock min-max MHz / max temp C",
        f"{min(clocks, default=0):.0f}-{max(clocks, default=0):.0f} / {max(temps, default=0):.0f}",
    )
    _line("burn throttle reasons / fault samples", f"{reasons} / {outcome.fault_samples}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpu-tests-passed", type=int, default=0)
    parser.add_argument("--gpu-tests-failed", type=int, default=0)
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    target = devices.cuda_targets()[0] if on_gpu else devices.cpu_target()
    _line("device", f"{target.name} ({target.device_id}), backend {devices.backend_for(target)}")
    if on_gpu:
        gemm_ratio = _gemm(target, 8192, ("bf16", "fp8"), iters=20)
        copy_ratio = _stream(target, 2 << 30, iters=20)
        _sdc(target, 4096, 1 << 26)
        _burn(target, 10.0, 8192)
        torch.cuda.empty_cache()
        outcome = _memtest(target, full=False, cpu_bytes=16)
    else:
        # The interpreter runs Triton kernels in NumPy: tiny sizes, and ratios far below 1.
        gemm_ratio = _gemm(target, 128, ("fp32",), iters=5)
        copy_ratio = _stream(target, 1 << 20, iters=7)
        _sdc(target, 128, 1 << 14)
        outcome = _memtest(target, full=True, cpu_bytes=64 << 20)
    summary = {
        "gemm_ratio_to_torch": float(f"{gemm_ratio or 0.0:.4g}"),
        "copy_ratio_to_torch": float(f"{copy_ratio or 0.0:.4g}"),
        "memtest_coverage": float(f"{outcome.coverage:.4g}"),
        "memtest_tb_per_s": float(f"{outcome.tb_per_s:.4g}"),
        "gpu_tests_passed": args.gpu_tests_passed,
        "gpu_tests_failed": args.gpu_tests_failed,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
