"""vigil's four Grafana dashboards: training job and GPU and node here; fleet and vigil itself
in ops_dashboards.py; what they share in panels.py.

Every query filters on the dashboard variables (namespace, job, node, rank, as each series
carries them), rates use `$__rate_interval`, per-rank panels show the top or bottom k ranks and
job-level panels read the recording rules of rules.py, so no panel returns more than ~20 series
however large the job. Series that name a job (and a rank) link to the web UI's job page.
Pure data: builder.py renders it; docs/metrics.md describes the series queried here.
"""

from __future__ import annotations

from vigil.collector.grafana import builder, ops_dashboards, rules
from vigil.collector.grafana.builder import Json, Panel, Query, job_link
from vigil.collector.grafana.panels import (
    JOB,
    NS,
    RANK,
    RANK_LINK,
    RI,
    TOP,
    UIDS,
    links,
    over_range,
    pinned,
    stat,
    ts,
    variables,
)

__all__ = ["UIDS", "all_dashboards", "gpu_node", "over_range", "pinned", "training_job"]


def training_job() -> Json:
    median = f"{rules.COMPUTE_P50}{{{JOB}}}"
    compute = rules.compute("{" + RANK + "}")
    ratio = f"({compute} / on (namespace, job_id) group_left {median})"
    panels = [
        ts(
            "Step time p50 / p99 / max",
            "Across the job's ranks, from the recording rules (cheap at any rank count).",
            "s",
            Query(expr=f"{rules.STEP_P50}{{{JOB}}}", legend="{{job_id}} p50"),
            Query(expr=f"{rules.STEP_P99}{{{JOB}}}", legend="{{job_id}} p99"),
            Query(expr=f"{rules.STEP_MAX}{{{JOB}}}", legend="{{job_id}} max"),
            link=job_link("metric=step_time"),
            minimum=0,
        ),
        ts(
            f"Slowest {TOP} ranks: compute time",
            "The ranks with the longest compute in their last step (step minus exposed "
            "communication wait): a straggler's peers wait for it, so its step time alone "
            "does not stand out, its compute does (top-k per evaluation).",
            "s",
            Query(
                expr=pinned("topk", compute, "job_id, rank", over_range(compute, subquery=True)),
                legend="{{job_id}} rank {{rank}}",
            ),
            link=job_link("metric=compute" + RANK_LINK),
            minimum=0,
        ),
        Panel(
            kind="status-history",
            title=f"Slowest {TOP} ranks over time (compute / job median)",
            description="One row per rank among the slowest; 1 = the job's median compute time.",
            unit="none",
            queries=(
                Query(
                    expr=pinned("topk", ratio, "job_id, rank", over_range(ratio, subquery=True)),
                    legend="rank {{rank}}",
                ),
            ),
            link=job_link("metric=compute" + RANK_LINK),
            width=24,
        ),
        Panel(
            kind="heatmap",
            title="Ranks by compute time relative to the job median",
            description="How many ranks fall in each band of compute time over the job's "
            "median (recorded buckets, so the panel reads 9 series per job).",
            unit="none",
            queries=(
                Query(
                    expr=f"sum by (le) ({rules.COMPUTE_RATIO_BUCKET}{{{JOB}}})",
                    legend="{{le}}",
                    heatmap=True,
                ),
            ),
            width=24,
        ),
        ts(
            "MFU",
            "Model FLOPs utilisation: the job's mean and its lowest rank.",
            "percentunit",
            Query(expr=f"{rules.MFU_AVG}{{{JOB}}}", legend="{{job_id}} mean"),
            Query(expr=f"{rules.MFU_MIN}{{{JOB}}}", legend="{{job_id}} lowest rank"),
            link=job_link("metric=mfu"),
            minimum=0,
        ),
        ts(
            "Tokens per second",
            "Tokens the job's ranks process per second (each rank's tokens / step time, summed).",
            "short",
            Query(expr=f"{rules.TOKENS}{{{JOB}}}", legend="{{job_id}}"),
            link=job_link("metric=step_time"),
            minimum=0,
        ),
        ts(
            "Exposed communication share",
            "Median share of a step the training thread waited in communication.",
            "percentunit",
            Query(expr=f"{rules.COMM_SHARE}{{{JOB}}}", legend="{{job_id}}"),
            link=job_link("metric=wait"),
            minimum=0,
        ),
        ts(
            "Data-loader wait",
            "Seconds the newest step spent waiting for data (median and slowest rank).",
            "s",
            Query(
                expr=f"vigil_collector_job_data_wait_seconds{{{JOB}}}", legend="{{job_id}} {{stat}}"
            ),
            link=job_link("metric=step_time"),
            minimum=0,
        ),
        ts(
            "Collective time per (group, op)",
            "Median over ranks of the newest step's collective seconds, by group kind and op.",
            "s",
            Query(
                expr=f"vigil_collector_job_collective_seconds{{{JOB}}}",
                legend="{{job_id}} {{group}} {{op}}",
            ),
            link=job_link("metric=collective"),
            minimum=0,
        ),
        ts(
            "Checkpoint stall",
            "Seconds training was blocked by the newest checkpoint.",
            "s",
            Query(expr=f"vigil_collector_checkpoint_blocked_seconds{{{JOB}}}", legend="{{job_id}}"),
            link=job_link(),
            minimum=0,
        ),
        Panel(
            kind="table",
            title="Open findings by kind",
            description="Findings of the job still open, by kind (the analyzer and the agents).",
            unit="short",
            queries=(
                Query(
                    expr=f'sum by (job_id, kind) (vigil_collector_findings{{{JOB}, state="open"}})',
                    instant=True,
                    table=True,
                ),
            ),
            link=job_link(),
        ),
        ts(
            "Seconds since progress (slowest rank)",
            "The longest any rank has gone without progress; hung ranks climb until detected.",
            "s",
            Query(expr=f"{rules.PROGRESS_AGE}{{{JOB}}}", legend="{{job_id}}"),
            link=job_link(),
            minimum=0,
        ),
        stat(
            "Restarts",
            "Succeeded restarts of the job (restart, migrate, resize).",
            "short",
            Query(expr=f"sum by (job_id) (vigil_collector_job_restarts{{{JOB}}})", instant=True),
            link=job_link(),
        ),
        stat(
            "Time to recover",
            "The newest recovery: from the finding's detection to the new attempt's first step.",
            "s",
            Query(
                expr=f"max by (job_id) (vigil_collector_job_time_to_recover_seconds{{{JOB}}})",
                instant=True,
            ),
            link=job_link(),
        ),
        stat(
            "Steps lost",
            "Steps trained again after restarts (since the last snapshot or checkpoint).",
            "short",
            Query(expr=f"sum by (job_id) (vigil_collector_job_steps_lost{{{JOB}}})", instant=True),
            link=job_link(),
        ),
        stat(
            "Last step",
            "The newest step any rank of the job reported to the collector.",
            "short",
            Query(expr=f"max by (job_id) (vigil_collector_job_last_step{{{JOB}}})", instant=True),
            link="${vigil_ui}/ui/jobs/${__field.labels.job_id}?step=${__value.raw}",
        ),
    ]
    return builder.dashboard(
        uid=UIDS["training-job"],
        title="vigil / Training job",
        description="Step time, stragglers, MFU, throughput, communication, data, checkpoints, "
        "findings and recoveries of one training job.",
        variables=variables(),
        panels=panels,
        links=links(),
    )


def _gpu(title: str, desc: str, unit: str, metric: str, pick: str = "topk") -> Panel:
    return ts(
        title,
        desc,
        unit,
        Query(
            expr=pinned(
                pick, f"{metric}{{{RANK}}}", "node, device", over_range(f"{metric}{{{RANK}}}")
            ),
            legend="{{job_id}} rank {{rank}} {{pod}} ({{node}} {{device}})",
        ),
        link=job_link("metric=step_time" + RANK_LINK),
    )


def _host(title: str, desc: str, unit: str, metric: str) -> Panel:
    on_job = f"and on (node) vigil_sdk_last_step{{{RANK}}}"
    series = f'{metric}{{{NS}, node=~"$node"}}'
    over = f"({over_range(series)} {on_job} @ end())"
    return ts(
        title,
        desc + " Nodes running the selected jobs' ranks.",
        unit,
        Query(expr=pinned("topk", f"{series} {on_job}", "node", over), legend="{{node}}"),
    )


def _counter(title: str, desc: str, metric: str) -> Panel:
    return ts(
        title,
        desc,
        "short",
        Query(
            expr=pinned(
                "topk",
                f"increase({metric}{{{RANK}}}[{RI}])",
                "node, device",
                over_range(f"{metric}{{{RANK}}}", fn="increase"),
            ),
            legend="{{job_id}} rank {{rank}} ({{node}} {{device}})",
        ),
        link=job_link("metric=step_time" + RANK_LINK),
        minimum=0,
    )


def gpu_node() -> Json:
    panels = [
        stat(
            "GPU utilisation (job mean)",
            "Mean NVML utilisation of the GPUs the job's ranks use.",
            "percentunit",
            Query(expr=f"{rules.GPU_UTIL}{{{JOB}}}", instant=True),
            link=job_link(),
        ),
        _gpu(
            "GPU utilisation (least busy)",
            "NVML utilisation, lowest first.",
            "percentunit",
            "vigil_gpu_utilization_ratio",
            "bottomk",
        ),
        _gpu(
            "SM clock (slowest)",
            "SM clock; a throttled GPU runs slower.",
            "hertz",
            "vigil_gpu_sm_clock_hertz",
            "bottomk",
        ),
        _gpu(
            "GPU memory used",
            "Device memory in use (NVML).",
            "bytes",
            "vigil_gpu_memory_used_bytes",
        ),
        _gpu("Power", "Board power draw.", "watt", "vigil_gpu_power_watts"),
        _gpu("Temperature", "GPU core temperature.", "celsius", "vigil_gpu_temperature_celsius"),
        Panel(
            kind="status-history",
            title="Throttle reasons",
            description="NVML clock-event reason bitmask per GPU (0 = none; 4 SW power cap, "
            "8 HW slowdown, 32 SW thermal, 64 HW thermal, 128 power brake).",
            unit="none",
            queries=(
                Query(
                    expr=pinned(
                        "topk",
                        f"vigil_gpu_throttle_reasons{{{RANK}}}",
                        "node, device",
                        over_range(f"vigil_gpu_throttle_reasons{{{RANK}}}", fn="max_over_time"),
                    ),
                    legend="{{job_id}} rank {{rank}} ({{node}} {{device}})",
                ),
            ),
            link=job_link("metric=compute" + RANK_LINK),
            width=24,
        ),
        _counter(
            "ECC errors (uncorrected)",
            "Uncorrected ECC errors in the interval.",
            "vigil_gpu_ecc_uncorrected_errors_total",
        ),
        _counter(
            "XID events",
            "Critical XID events NVML reported in the interval.",
            "vigil_gpu_xid_events_total",
        ),
        _gpu(
            "PCIe receive",
            "PCIe receive throughput.",
            "Bps",
            "vigil_gpu_pcie_receive_bytes_per_second",
        ),
        _gpu(
            "PCIe transmit",
            "PCIe transmit throughput.",
            "Bps",
            "vigil_gpu_pcie_transmit_bytes_per_second",
        ),
        _host(
            "Host CPU", "Host CPU utilisation.", "percentunit", "vigil_host_cpu_utilization_ratio"
        ),
        _host("Host memory used", "Host memory in use.", "bytes", "vigil_host_memory_used_bytes"),
        _host(
            "Network receive",
            "Host network receive rate.",
            "Bps",
            "vigil_host_network_receive_bytes_per_second",
        ),
        _host(
            "Network transmit",
            "Host network transmit rate.",
            "Bps",
            "vigil_host_network_transmit_bytes_per_second",
        ),
    ]
    return builder.dashboard(
        uid=UIDS["gpu-node"],
        title="vigil / GPU and node",
        description="NVML and host readings of the node agents, attributed to job, rank and pod.",
        variables=variables(),
        panels=panels,
        links=links(),
    )


def all_dashboards() -> dict[str, Json]:
    """File stem -> dashboard JSON."""
    return {
        "training-job": training_job(),
        "gpu-node": gpu_node(),
        "fleet": ops_dashboards.fleet(),
        "vigil": ops_dashboards.vigil_self(),
    }
