"""CPU figures of vigil's diagnostic kernels, printed like bench/gpu/run.sh prints GPU ones.

Runs bench/diag_bench.py on the CPU with Triton's interpreter (TRITON_INTERPRET=1, set here
before any kernel is imported), then the `gpu`-marked tests, which skip without CUDA, to fill
the gpu test counts honestly (0 / 0 here). The last line is the same JSON object as on a GPU.
Usage: .venv/bin/python bench/diag_cpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_test_counts() -> tuple[int, int]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "tests/kernels",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"{'gpu-marked tests (skip without CUDA)':<44} {summary}", flush=True)
    counts = {"passed": 0, "failed": 0, "error": 0}
    for part in summary.replace(",", " ").split(" in ")[0].split("  "):
        words = part.split()
        for i in range(0, len(words) - 1, 2):
            if words[i + 1] in counts and words[i].isdigit():
                counts[words[i + 1]] = int(words[i])
    return counts["passed"], counts["failed"] + counts["error"]


def main() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    # One intra-op thread: on a shared, oversubscribed CPU, OpenMP's barrier between two threads
    # stalls for milliseconds when the second one is descheduled, and a 1 MiB copy then takes
    # 20 ms instead of 20 us. Single-threaded figures are slower in principle but reproducible.
    threads = int(os.environ.get("VIGIL_BENCH_THREADS", "1"))
    torch.set_num_threads(threads)
    print(f"{'torch intra-op threads':<44} {threads}", flush=True)
    passed, failed = _gpu_test_counts()
    sys.argv = [
        sys.argv[0],
        "--device",
        "cpu",
        f"--gpu-tests-passed={passed}",
        f"--gpu-tests-failed={failed}",
    ]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import diag_bench

    diag_bench.main()


if __name__ == "__main__":
    main()
