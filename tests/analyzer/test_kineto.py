"""Kineto import: HolisticTraceAnalysis' reference figures, NCCL metadata, alignment, bad files."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from vigil.analyzer import kineto, kineto_analysis, offline

# Reference figures from the shared testdata README (HolisticTraceAnalysis on step 551).
REFERENCE = {
    0: {"idle": 53.56, "compute": 17.71, "non_compute": 28.74, "overlap": 11.81},
    1: {"idle": 54.72, "compute": 22.57, "non_compute": 22.72, "overlap": 20.05},
}


@pytest.mark.parametrize("rank", [0, 1])
def test_breakdown_and_overlap_match_hta_reference(kineto_dir: Path, rank: int) -> None:
    trace = kineto.load(kineto_dir / f"trace_filter_sampled_rank-{rank}.json.gz")
    assert (trace.rank, trace.world_size, trace.backend) == (rank, 128, "nccl")
    b = kineto_analysis.temporal_breakdown(trace)
    ref = REFERENCE[rank]
    assert b.idle_pct == pytest.approx(ref["idle"], abs=0.1)
    assert b.compute_pct == pytest.approx(ref["compute"], abs=0.1)
    assert b.non_compute_pct == pytest.approx(ref["non_compute"], abs=0.1)
    assert kineto_analysis.comm_comp_overlap_pct(trace) == pytest.approx(ref["overlap"], abs=0.1)


def test_last_incomplete_profiler_step_is_dropped(kineto_dir: Path) -> None:
    trace = kineto.load(kineto_dir / "trace_filter_sampled_rank-0.json.gz")
    assert [s[0] for s in trace.profiler_steps] == [551, 552]
    step_552_start = trace.profiler_steps[1][1]
    # Kernels launched during step 552 are gone; the span is step 551's GPU work only.
    assert kineto_analysis.temporal_breakdown(trace).span_us < step_552_start - trace.ts[0] + 1e6
    assert trace.ts.size < 1154  # of the 1,154 kernel events in the file


def test_collective_metadata_from_kernel_args(kineto_dir: Path) -> None:
    trace = kineto.load(kineto_dir / "nccl_parser_config_nccl_data.json.gz")
    assert trace.world_size == 2  # distributedInfo is a Python repr string in this file
    metas = list(trace.nccl.values())
    ops = {m.op for m in metas}
    assert {"allreduce", "broadcast"} <= ops
    allreduce = next(m for m in metas if m.op == "allreduce")
    assert (allreduce.group, allreduce.group_desc, allreduce.group_size) == ("0", "default_pg", 2)
    assert allreduce.algorithm == "RING" and allreduce.protocol == "LL"
    assert allreduce.bytes == allreduce.in_nelems * 4  # Float


@pytest.mark.parametrize(
    ("name", "op", "algo", "proto", "dtype"),
    [
        (
            "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
            "AllReduce",
            "RING",
            "LL",
            "float",
        ),
        (
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "AllGather",
            "RING",
            "LL",
            "",
        ),
        (
            "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL128(ncclDevKernelArgsStorage<4096ul>)",
            "ReduceScatter",
            "RING",
            "LL128",
            "bf16",
        ),
        (
            "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
            "SendRecv",
            "RING",
            "SIMPLE",
            "int8_t",
        ),
    ],
)
def test_old_and_new_nccl_kernel_names(
    name: str, op: str, algo: str, proto: str, dtype: str
) -> None:
    meta = kineto.parse_nccl_name(name)
    assert (meta.op, meta.algorithm, meta.protocol, meta.dtype) == (op, algo, proto, dtype)
    assert kineto.kernel_type(name) == kineto.COMMUNICATION


def test_kernel_breakdown_ranks_kernels_by_time(kineto_dir: Path) -> None:
    trace = kineto.load(kineto_dir / "nccl_parser_config_nccl_data.json.gz")
    top = kineto_analysis.kernel_breakdown(trace, top=3)
    assert top[0].kind == "communication" and top[0].name.startswith("ncclKernel_AllReduce")
    assert top[0].total_us >= top[1].total_us >= top[2].total_us
    assert sum(
        k.share_pct for k in kineto_analysis.kernel_breakdown(trace, top=10**6)
    ) == pytest.approx(100)


def _synthetic_rank(path: Path, rank: int, offset_us: float, late_us: float) -> None:
    """A two-rank job's trace: 6 all-reduces; this rank's clock is `offset_us` ahead and it
    launches each collective `late_us` late (the collective still ends together)."""
    events = []
    for i in range(6):
        base = 1_000_000 + i * 10_000
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "gemm_kernel",
                "ts": base + offset_us,
                "dur": 3000 + late_us,
                "args": {"stream": 7, "correlation": 100 + i},
            }
        )
        start = base + 3000 + late_us + offset_us
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "ts": start,
                "dur": 2000 - late_us,
                "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                "args": {
                    "stream": 20,
                    "correlation": 200 + i,
                    "Collective name": "allreduce",
                    "Process Group Name": "0",
                    "In msg nelems": 1024,
                    "Out msg nelems": 1024,
                    "dtype": "Float",
                    "Group size": 2,
                },
            }
        )
    doc = {
        "distributedInfo": {"rank": rank, "world_size": 2, "backend": "nccl"},
        "traceEvents": events,
    }
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))


def test_clock_alignment_and_lagging_rank(tmp_path: Path) -> None:
    _synthetic_rank(tmp_path / "rank-0.json.gz", 0, 0.0, 0.0)
    _synthetic_rank(tmp_path / "rank-1.json.gz", 1, 250_000.0, 1500.0)
    traces = [kineto.load(tmp_path / f"rank-{r}.json.gz") for r in (0, 1)]
    alignment = kineto_analysis.align_clocks(traces)
    assert alignment is not None and alignment.matched == 6
    assert alignment.offsets_us[1] == pytest.approx(250_000.0)
    assert alignment.residual_us[1] == pytest.approx(0.0, abs=1.0)
    lags = {lag.rank: lag for lag in kineto_analysis.lagging_ranks(traces, alignment)}
    assert lags[1].last_share == 1.0 and lags[1].median_lateness_us == pytest.approx(1500.0)
    report = offline.analyze_path(tmp_path, job_id="synthetic")
    stragglers = [f for f in report.findings if f.kind == "straggler"]
    assert [f.subjects.ranks for f in stragglers] == [[1]]
    assert any(e.metric == "clock_residual_skew" for e in stragglers[0].evidence)


def test_corrupt_trace_is_named_and_other_ranks_still_analyzed(
    tmp_path: Path, kineto_dir: Path, data_dir: Path
) -> None:
    shutil.copy(kineto_dir / "trace_filter_sampled_rank-0.json.gz", tmp_path)
    shutil.copy(data_dir / "kineto_corrupt" / "trace_filter_sampled_rank-1.json.gz", tmp_path)
    (tmp_path / "garbage.json").write_text('{"traceEvents": [{"ph": "X", "ts": "soon"')
    report = offline.analyze_path(tmp_path)
    assert [t.rank for t in report.traces] == [0]
    assert report.traces[0].breakdown.idle_pct == pytest.approx(53.56, abs=0.1)
    reasons = {Path(e.path).name: e.reason for e in report.errors}
    assert "EOFError" in reasons["trace_filter_sampled_rank-1.json.gz"]
    assert "not a Kineto/Chrome trace" in reasons["garbage.json"]


def test_cpu_only_trace_is_reported_not_broken_down(kineto_dir: Path) -> None:
    trace = kineto.load(kineto_dir / "cpu_only_rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz")
    assert (trace.rank, trace.world_size, trace.backend, trace.has_gpu) == (34, 300, "gloo", False)


def test_collective_stats_group_kernels_with_their_sizes(kineto_dir: Path) -> None:
    trace = kineto.load(kineto_dir / "nccl_parser_config_nccl_data.json.gz")
    stats = kineto_analysis.collective_stats(trace)
    allreduce = next(c for c in stats if c.op == "allreduce" and c.dtype == "Float")
    assert (allreduce.group, allreduce.algorithm, allreduce.protocol) == ("0", "RING", "LL")
    assert allreduce.count == 10 and allreduce.total_bytes > 0
    assert sum(c.count for c in stats) == len(trace.nccl)
    old = kineto_analysis.collective_stats(
        kineto.load(kineto_dir / "trace_filter_sampled_rank-0.json.gz")
    )
    assert [(c.op, c.total_bytes) for c in old] == [("SendRecv", -1)]  # no sizes in 2023 traces
