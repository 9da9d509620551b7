"""Kineto import beside HolisticTraceAnalysis on the same files: speed, peak memory, agreement.

For each dataset (the two-rank trace_filter job, and two single-rank A100 traces from the shared
testdata) both tools load the traces and compute the temporal breakdown and the
communication-computation overlap:
  - vigil: `vigil.analyzer.kineto.load` + `kineto_analysis.temporal_breakdown` /
    `comm_comp_overlap_pct`,
  - HTA: `Trace.load_traces(use_multiprocessing=False)` + `get_temporal_breakdown` /
    `get_comm_comp_overlap` (HTA's own pipeline, single process, so both use one core).
Each measurement runs in a fresh subprocess, and both tools are treated alike: every module the
tool's run imports (vigil's analyzer; HTA's trace, breakdown and communication analyzers with
pandas, plotly and the rest) is imported first, timed on its own and printed as the tool's
import cost, outside the timed and memory-traced region. Then wall time (median of --rounds
processes, min-max beside it, no tracing) and peak traced memory (tracemalloc: Python objects,
numpy/pandas buffers, decompressed bytes). Needs `pip install -c constraints.txt -e '.[bench]'`
(holistictraceanalysis). The last line is one JSON object: {"speedup_vs_hta",
"memory_ratio_vs_hta", "max_breakdown_error_pp"} with the worst dataset's speedup (of the median
times) and memory ratio and the largest difference in any percentage, and beside them
{"vigil_import_s", "hta_import_s"} (median import cost of a fresh process) and
{"speedup_spread_vs_hta"} (the worst dataset's speedup from the slowest vigil and fastest HTA
round, and from the fastest vigil and slowest HTA round).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATASETS = {
    "trace_filter (2 ranks)": [
        "trace_filter_sampled_rank-0.json.gz",
        "trace_filter_sampled_rank-1.json.gz",
    ],
    "nccl_parser (A100)": ["nccl_parser_config_nccl_data.json.gz"],
    "negative_queue (A100-80GB)": ["negative_queue_length_values_check_rank0.json.gz"],
}


def shared_kineto() -> Path:
    for base in (ROOT.parent, *ROOT.parents):
        if (base / "shared" / "testdata" / "kineto").is_dir():
            return base / "shared" / "testdata" / "kineto"
    raise SystemExit("shared/testdata/kineto not found beside or above the repository")


def import_vigil() -> None:
    from vigil.analyzer import kineto, kineto_analysis  # noqa: F401


def import_hta() -> None:
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis  # noqa: F401
    from hta.analyzers.communication_analysis import CommunicationAnalysis  # noqa: F401
    from hta.common.trace import Trace  # noqa: F401


def run_vigil(folder: Path) -> dict[int, dict[str, float]]:
    from vigil.analyzer import kineto, kineto_analysis

    out = {}
    for path in sorted(folder.iterdir()):
        trace = kineto.load(path)
        b = kineto_analysis.temporal_breakdown(trace)
        out[trace.rank] = {
            "idle": b.idle_pct,
            "compute": b.compute_pct,
            "non_compute": b.non_compute_pct,
            "overlap": kineto_analysis.comm_comp_overlap_pct(trace),
        }
    return out


def run_hta(folder: Path) -> dict[int, dict[str, float]]:
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.analyzers.communication_analysis import CommunicationAnalysis
    from hta.common.trace import Trace

    trace = Trace(trace_dir=str(folder))
    trace.load_traces(use_multiprocessing=False)
    breakdown = BreakdownAnalysis.get_temporal_breakdown(trace, visualize=False)
    overlap = CommunicationAnalysis.get_comm_comp_overlap(trace, visualize=False)
    out = {}
    overlap_by_rank = {int(r["rank"]): r for r in overlap.to_dict("records")}
    for row in breakdown.to_dict("records"):
        span = row["kernel_time(us)"]
        out[int(row["rank"])] = {
            "idle": 100 * row["idle_time(us)"] / span,
            "compute": 100 * row["compute_time(us)"] / span,
            "non_compute": 100 * row["non_compute_time(us)"] / span,
            # HTA reports overlap only as a percentage rounded to 2 decimals.
            "overlap": float(overlap_by_rank[int(row["rank"])]["comp_comm_overlap_pctg"]),
        }
    return out


def worker(tool: str, mode: str, folder: Path) -> dict[str, Any]:
    """One measurement in this (fresh) process: the tool's imports first, timed apart and
    outside the measured region, then the run itself (timed, or memory-traced)."""
    logging.disable(logging.CRITICAL)
    run, load = (run_vigil, import_vigil) if tool == "vigil" else (run_hta, import_hta)
    start = time.perf_counter()
    load()
    import_s = time.perf_counter() - start
    if mode == "memory":
        tracemalloc.start()
        figures = run(folder)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return {"peak_bytes": peak, "figures": figures, "import_s": import_s}
    start = time.perf_counter()
    figures = run(folder)
    return {"seconds": time.perf_counter() - start, "figures": figures, "import_s": import_s}


def measure(tool: str, mode: str, folder: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", tool, mode, str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{tool} {mode} failed on {folder}:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds per tool and dataset")
    parser.add_argument(
        "--worker", nargs=3, metavar=("TOOL", "MODE", "DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        tool, mode, folder = args.worker
        print(json.dumps(worker(tool, mode, Path(folder))))
        return
    source = shared_kineto()
    speedups, spreads, memory_ratios, errors = [], [], [], []
    imports: dict[str, list[float]] = {"vigil": [], "hta": []}
    print(
        f"{'dataset':<28} {'vigil s (min-max)':>20} {'HTA s (min-max)':>20} {'speedup':>8} "
        f"{'vigil MiB':>10} {'HTA MiB':>9} {'mem ratio':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, files in DATASETS.items():
            folder = Path(tmp) / name.split()[0]
            folder.mkdir()
            for f in files:
                shutil.copy(source / f, folder / f)
            t: dict[str, list[float]] = {"vigil": [], "hta": []}
            for _ in range(args.rounds):  # alternating, so both meet the same load
                for tool in ("vigil", "hta"):
                    result = measure(tool, "time", folder)
                    t[tool].append(result["seconds"])
                    imports[tool].append(result["import_s"])
            med = {tool: statistics.median(v) for tool, v in t.items()}
            m = {tool: measure(tool, "memory", folder) for tool in ("vigil", "hta")}
            speedups.append(med["hta"] / med["vigil"])
            spreads.append((min(t["hta"]) / max(t["vigil"]), max(t["hta"]) / min(t["vigil"])))
            memory_ratios.append(m["vigil"]["peak_bytes"] / m["hta"]["peak_bytes"])
            mib = {k: v["peak_bytes"] / 2**20 for k, v in m.items()}
            cells = {tool: f"{med[tool]:.3f} ({min(v):.3f}-{max(v):.3f})" for tool, v in t.items()}
            print(
                f"{name:<28} {cells['vigil']:>20} {cells['hta']:>20} {speedups[-1]:7.1f}x "
                f"{mib['vigil']:10.1f} {mib['hta']:9.1f} {memory_ratios[-1]:9.3f}"
            )
            ours, theirs = m["vigil"]["figures"], m["hta"]["figures"]
            for rank in theirs:
                for key in ("idle", "compute", "non_compute", "overlap"):
                    diff = abs(ours[rank][key] - theirs[rank][key])
                    errors.append(diff)
                line = "  ".join(
                    f"{k} {ours[rank][k]:6.2f}/{theirs[rank][k]:6.2f}" for k in theirs[rank]
                )
                print(f"    rank {rank}: vigil/HTA %  {line}")
    import_s = {tool: statistics.median(v) for tool, v in imports.items()}
    print(
        "imports (fresh process, median; outside both tools' timed and traced regions): "
        + ", ".join(
            f"{tool} {import_s[tool]:.3f} s ({min(v):.3f}-{max(v):.3f})"
            for tool, v in imports.items()
        )
    )
    worst = min(range(len(speedups)), key=speedups.__getitem__)
    print(
        f"worst dataset: {speedups[worst]:.1f}x faster (median of {args.rounds} rounds; "
        f"{spreads[worst][0]:.1f}x-{spreads[worst][1]:.1f}x over rounds), "
        f"{max(memory_ratios):.3f} of HTA's peak memory; "
        f"largest figure difference {max(errors):.4f} percentage points"
    )
    print(
        json.dumps(
            {
                "speedup_vs_hta": round(speedups[worst], 2),
                "memory_ratio_vs_hta": round(max(memory_ratios), 4),
                "max_breakdown_error_pp": round(max(errors), 4),
                "speedup_spread_vs_hta": [round(x, 2) for x in spreads[worst]],
                "vigil_import_s": round(import_s["vigil"], 3),
                "hta_import_s": round(import_s["hta"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
