"""vigil's four Grafana dashboards: training job, GPU and node, fleet, and vigil itself.

Every query filters on the dashboard variables (namespace, job, node, rank, as each series
carries them), rates use `$__rate_interval`, per-rank panels show the top or bottom k ranks and
job-level panels read the recording rules of rules.py, so no panel returns more than ~20 series
however large the job. Series that name a job (and a rank) link to the web UI's job page.
Pure data: builder.py renders it; docs/metrics.md describes the series queried here.
"""

from __future__ import annotations

from vigil.collector.grafana import builder, rules
from vigil.collector.grafana.builder import Json, Panel, Query, job_link

NS = 'namespace=~"$namespace"'
JOB = f'{NS}, job_id=~"$job"'
RANK = f'{JOB}, node=~"$node", rank=~"$rank"'
TOP = 10  # ranks, GPUs or nodes a per-entity panel shows
RI = "$__rate_interval"
RANK_LINK = "&rank=${__field.labels.rank}"
RANGE = "$__range"  # the dashboard's whole time range


def pinned(pick: str, expr: str, on: str, over: str) -> str:
    """`expr` for the TOP series `pick` (topk / bottomk) chooses by `over` evaluated once at the
    range's end (`@ end()`): the same series at every step, so a range query returns TOP series
    rather than TOP new ones per step."""
    return f"{expr} and on ({on}) {pick}({TOP}, {over})"


def over_range(expr: str, *, fn: str = "avg_over_time", subquery: bool = False) -> str:
    """`fn` of `expr` over the dashboard's range, at its end; a subquery (1 m resolution) when
    `expr` is not a plain selector."""
    window = f"[{RANGE}:1m]" if subquery else f"[{RANGE}]"
    return f"{fn}({expr}{window} @ end())"


UIDS = {
    "training-job": "vigil-training-job",
    "gpu-node": "vigil-gpu-node",
    "fleet": "vigil-fleet",
    "vigil": "vigil-self",
}


def _ts(
    title: str,
    desc: str,
    unit: str,
    *queries: Query,
    link: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    stacked: bool = False,
) -> Panel:
    return Panel(
        kind="timeseries",
        title=title,
        description=desc,
        unit=unit,
        queries=queries,
        link=link,
        minimum=minimum,
        maximum=maximum,
        stacked=stacked,
    )


def _stat(title: str, desc: str, unit: str, query: Query, *, link: str | None = None) -> Panel:
    return Panel(
        kind="stat",
        title=title,
        description=desc,
        unit=unit,
        queries=(query,),
        width=6,
        height=5,
        link=link,
    )


def _variables(*, nodes: str = f"vigil_sdk_last_step{{{JOB}}}") -> list[Json]:
    jobs = f"vigil_collector_job_last_step{{{NS}}}"
    ranks = f'vigil_sdk_last_step{{{JOB}, node=~"$node"}}'
    return [
        builder.datasource_variable(),
        builder.query_variable(
            "namespace", "Namespace", "vigil_collector_job_last_step", "namespace"
        ),
        builder.query_variable("job", "Job", jobs, "job_id"),
        builder.query_variable("node", "Node", nodes, "node"),
        builder.query_variable("rank", "Rank", ranks, "rank"),
        builder.ui_variable(),
    ]


def _links() -> list[Json]:
    return [
        {
            "title": "vigil dashboards",
            "type": "dashboards",
            "tags": ["vigil"],
            "asDropdown": True,
            "includeVars": True,
            "keepTime": True,
        },
        {"title": "vigil UI", "type": "link", "url": "${vigil_ui}/ui/", "targetBlank": True},
    ]


def training_job() -> Json:
    median = f"{rules.COMPUTE_P50}{{{JOB}}}"
    compute = rules.compute("{" + RANK + "}")
    ratio = f"({compute} / on (namespace, job_id) group_left {median})"
    panels = [
        _ts(
            "Step time p50 / p99 / max",
            "Across the job's ranks, from the recording rules (cheap at any rank count).",
            "s",
            Query(expr=f"{rules.STEP_P50}{{{JOB}}}", legend="{{job_id}} p50"),
            Query(expr=f"{rules.STEP_P99}{{{JOB}}}", legend="{{job_id}} p99"),
            Query(expr=f"{rules.STEP_MAX}{{{JOB}}}", legend="{{job_id}} max"),
            link=job_link("metric=step_time"),
            minimum=0,
        ),
        _ts(
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
        _ts(
            "MFU",
            "Model FLOPs utilisation: the job's mean and its lowest rank.",
            "percentunit",
            Query(expr=f"{rules.MFU_AVG}{{{JOB}}}", legend="{{job_id}} mean"),
            Query(expr=f"{rules.MFU_MIN}{{{JOB}}}", legend="{{job_id}} lowest rank"),
            link=job_link("metric=mfu"),
            minimum=0,
        ),
        _ts(
            "Tokens per second",
            "Tokens the job's ranks process per second (each rank's tokens / step time, summed).",
            "short",
            Query(expr=f"{rules.TOKENS}{{{JOB}}}", legend="{{job_id}}"),
            link=job_link("metric=step_time"),
            minimum=0,
        ),
        _ts(
            "Exposed communication share",
            "Median share of a step the training thread waited in communication.",
            "percentunit",
            Query(expr=f"{rules.COMM_SHARE}{{{JOB}}}", legend="{{job_id}}"),
            link=job_link("metric=wait"),
            minimum=0,
        ),
        _ts(
            "Data-loader wait",
            "Seconds the newest step spent waiting for data (median and slowest rank).",
            "s",
            Query(
                expr=f"vigil_collector_job_data_wait_seconds{{{JOB}}}", legend="{{job_id}} {{stat}}"
            ),
            link=job_link("metric=step_time"),
            minimum=0,
        ),
        _ts(
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
        _ts(
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
        _ts(
            "Seconds since progress (slowest rank)",
            "The longest any rank has gone without progress; hung ranks climb until detected.",
            "s",
            Query(expr=f"{rules.PROGRESS_AGE}{{{JOB}}}", legend="{{job_id}}"),
            link=job_link(),
            minimum=0,
        ),
        _stat(
            "Restarts",
            "Succeeded restarts of the job (restart, migrate, resize).",
            "short",
            Query(expr=f"sum by (job_id) (vigil_collector_job_restarts{{{JOB}}})", instant=True),
            link=job_link(),
        ),
        _stat(
            "Time to recover",
            "The newest recovery: from the finding's detection to the new attempt's first step.",
            "s",
            Query(
                expr=f"max by (job_id) (vigil_collector_job_time_to_recover_seconds{{{JOB}}})",
                instant=True,
            ),
            link=job_link(),
        ),
        _stat(
            "Steps lost",
            "Steps trained again after restarts (since the last snapshot or checkpoint).",
            "short",
            Query(expr=f"sum by (job_id) (vigil_collector_job_steps_lost{{{JOB}}})", instant=True),
            link=job_link(),
        ),
        _stat(
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
        variables=_variables(),
        panels=panels,
        links=_links(),
    )


def _gpu(title: str, desc: str, unit: str, metric: str, pick: str = "topk") -> Panel:
    return _ts(
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
    return _ts(
        title,
        desc + " Nodes running the selected jobs' ranks.",
        unit,
        Query(expr=pinned("topk", f"{series} {on_job}", "node", over), legend="{{node}}"),
    )


def _counter(title: str, desc: str, metric: str) -> Panel:
    return _ts(
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
        _stat(
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
        variables=_variables(),
        panels=panels,
        links=_links(),
    )


def fleet() -> Json:
    coll = f"{{{NS}}}"
    running = f"(vigil_collector_job_running{coll} == 1)"
    goodput = f"vigil_collector_job_goodput_ratio{coll}"
    running_at_end = f"(vigil_collector_job_running{coll} @ end() == 1)"
    panels = [
        _stat(
            "Jobs running",
            "Jobs whose rank 0 heartbeat reached the collector in the last minute.",
            "short",
            Query(expr=f"sum(vigil_collector_job_running{coll})", instant=True),
        ),
        _stat(
            "Nodes excluded by recovery",
            "Nodes recovery cordoned or moved jobs off (succeeded cordon / migrate actions).",
            "short",
            Query(expr=f"sum(vigil_collector_job_nodes_excluded{coll})", instant=True),
        ),
        _stat(
            "Spares taken",
            "Migrations of a job onto a spare node that succeeded.",
            "short",
            Query(
                expr=f'sum(vigil_collector_actions{{{NS}, kind="migrate", state="succeeded"}})',
                instant=True,
            ),
        ),
        _stat(
            "Restarts",
            "Succeeded restarts across the jobs followed.",
            "short",
            Query(expr=f"sum(vigil_collector_job_restarts{coll})", instant=True),
        ),
        Panel(
            kind="table",
            title="Jobs",
            description="Each job the collector follows: newest step, running, goodput, ranks.",
            unit="short",
            queries=(
                Query(expr=f"vigil_collector_job_last_step{coll}", instant=True, table=True),
                Query(expr=f"vigil_collector_job_running{coll}", instant=True, table=True),
                Query(expr=f"vigil_collector_job_goodput_ratio{coll}", instant=True, table=True),
            ),
            link=job_link(),
            width=24,
        ),
        _ts(
            f"Goodput (lowest {TOP} running jobs)",
            "Share of wall time not lost to recoveries, for the running jobs faring worst.",
            "percentunit",
            Query(
                expr=pinned(
                    "bottomk",
                    f"{goodput} and on (job_id) {running}",
                    "job_id",
                    f"({over_range(goodput)} and on (job_id) {running_at_end})",
                ),
                legend="{{job_id}}",
            ),
            link=job_link(),
            minimum=0,
            maximum=1,
        ),
        _ts(
            "Open findings by kind",
            "Open findings across the jobs followed.",
            "short",
            Query(
                expr=f'sum by (kind) (vigil_collector_findings{{{NS}, state="open"}})',
                legend="{{kind}}",
            ),
            stacked=True,
            minimum=0,
        ),
        _ts(
            "Recovery actions by kind and state",
            "Actions the recovery controller recorded.",
            "short",
            Query(
                expr=f"sum by (kind, state) (vigil_collector_actions{coll})",
                legend="{{kind}} {{state}}",
            ),
            minimum=0,
        ),
        _ts(
            f"Slowest {TOP} jobs: step time p50",
            "Median step time of the jobs with the longest steps.",
            "s",
            Query(
                expr=pinned(
                    "topk",
                    f"{rules.STEP_P50}{coll}",
                    "job_id",
                    over_range(f"{rules.STEP_P50}{coll}"),
                ),
                legend="{{job_id}}",
            ),
            link=job_link("metric=step_time"),
            minimum=0,
        ),
        _ts(
            f"Lowest {TOP} jobs: MFU",
            "Mean MFU of the jobs with the lowest.",
            "percentunit",
            Query(
                expr=pinned(
                    "bottomk",
                    f"{rules.MFU_AVG}{coll}",
                    "job_id",
                    over_range(f"{rules.MFU_AVG}{coll}"),
                ),
                legend="{{job_id}}",
            ),
            link=job_link("metric=mfu"),
            minimum=0,
        ),
    ]
    return builder.dashboard(
        uid=UIDS["fleet"],
        title="vigil / Fleet",
        description="Every job the collector follows: running, goodput, findings and recovery.",
        variables=_variables(),
        panels=panels,
        links=_links(),
    )


def _agent(title: str, desc: str, unit: str, expr: str) -> Panel:
    return _ts(title, desc, unit, Query(expr=expr, legend="{{instance}}"), minimum=0)


def vigil_self() -> Json:
    # Agent health series carry the scrape target's labels only: the agent's host series (same
    # instance) say which node it is.
    on_node = f'and on (instance) vigil_host_memory_used_bytes{{{NS}, node=~"$node"}}'
    coll = f"{{{NS}}}"
    rejected = "vigil_collector_rejected_batches_total"
    latency = f"sum by (le) (rate(vigil_collector_batch_latency_seconds_bucket{coll}[{RI}]))"
    panels = [
        _stat(
            "Agents reporting",
            "Node agents Prometheus scrapes (one series per agent).",
            "short",
            Query(expr=f"count(vigil_agent_queue_depth{coll} {on_node})", instant=True),
        ),
        _agent(
            "Agent queue depth",
            "Records waiting to be shipped, deepest queues.",
            "short",
            pinned(
                "topk",
                f"vigil_agent_queue_depth{coll} {on_node}",
                "instance",
                over_range(f"vigil_agent_queue_depth{coll}"),
            ),
        ),
        _agent(
            "Agent spool size",
            "Bytes spooled while the collector is away.",
            "bytes",
            pinned(
                "topk",
                f"vigil_agent_spool_bytes{coll} {on_node}",
                "instance",
                over_range(f"vigil_agent_spool_bytes{coll}"),
            ),
        ),
        _agent(
            "Agent drops",
            "Records agents dropped per second (queue or spool full).",
            "short",
            pinned(
                "topk",
                f"rate(vigil_agent_dropped_records_total{coll}[{RI}]) {on_node}",
                "instance",
                over_range(f"vigil_agent_dropped_records_total{coll}", fn="increase"),
            ),
        ),
        _agent(
            "Agent ship errors",
            "Failed POSTs to the collector per second.",
            "short",
            pinned(
                "topk",
                f"rate(vigil_agent_ship_errors_total{coll}[{RI}]) {on_node}",
                "instance",
                over_range(f"vigil_agent_ship_errors_total{coll}", fn="increase"),
            ),
        ),
        _ts(
            "SDK drops and errors by job",
            "Records the ranks' SDKs dropped and errors inside their hooks, per second.",
            "short",
            Query(
                expr=f"sum by (job_id) (rate(vigil_sdk_dropped_records_total{{{RANK}}}[{RI}]))",
                legend="{{job_id}} dropped",
            ),
            Query(
                expr=f"sum by (job_id) (rate(vigil_sdk_internal_errors_total{{{RANK}}}[{RI}]))",
                legend="{{job_id}} errors",
            ),
            link=job_link(),
            minimum=0,
        ),
        _ts(
            "Collector ingest rate",
            "Records committed per second, by record type.",
            "short",
            Query(
                expr=f"sum by (type) (rate(vigil_collector_ingested_rows_total{coll}[{RI}]))",
                legend="{{type}}",
            ),
            stacked=True,
            minimum=0,
        ),
        _ts(
            "Collector batch latency",
            "Seconds from a batch's body to its commit (p50, p99).",
            "s",
            Query(expr=f"histogram_quantile(0.5, {latency})", legend="p50"),
            Query(expr=f"histogram_quantile(0.99, {latency})", legend="p99"),
            minimum=0,
        ),
        _ts(
            "Collector batches by outcome",
            "Batches answered per second: committed, duplicate.",
            "short",
            Query(
                expr=f"sum by (outcome) (rate(vigil_collector_batches_total{coll}[{RI}]))",
                legend="{{outcome}}",
            ),
            minimum=0,
        ),
        _ts(
            "Collector refusals and failures",
            "Batches refused per second by reason (decode, auth, too_large: 4xx; store: 503).",
            "short",
            Query(expr=f"sum by (reason) (rate({rejected}{coll}[{RI}]))", legend="{{reason}}"),
            minimum=0,
        ),
        _ts(
            "Analyzer lag",
            "Batches waiting for the streaming analyzer; batches it dropped, errors (per second).",
            "short",
            Query(expr=f"max(vigil_collector_analyzer_pending{coll})", legend="pending"),
            Query(
                expr=f"sum(rate(vigil_collector_analyzer_dropped_batches_total{coll}[{RI}]))",
                legend="dropped/s",
            ),
            Query(
                expr=f"sum(rate(vigil_collector_analyzer_errors_total{coll}[{RI}]))",
                legend="errors/s",
            ),
            minimum=0,
        ),
        _ts(
            "Collector store",
            "Bytes the store occupies; seconds the job metrics' refresh took.",
            "bytes",
            Query(expr=f"max(vigil_collector_store_size_bytes{coll})", legend="store"),
            minimum=0,
        ),
        _ts(
            "Job metrics refresh",
            "Seconds the collector's store-derived job metrics took to refresh (cached).",
            "s",
            Query(expr=f"max(vigil_collector_job_metrics_refresh_seconds{coll})", legend="refresh"),
            minimum=0,
        ),
    ]
    return builder.dashboard(
        uid=UIDS["vigil"],
        title="vigil / vigil itself",
        description="Health of vigil's own parts: node agents, SDKs, collector and analyzer.",
        variables=_variables(nodes=f"vigil_host_memory_used_bytes{{{NS}}}"),
        panels=panels,
        links=_links(),
    )


def all_dashboards() -> dict[str, Json]:
    """File stem -> dashboard JSON."""
    return {
        "training-job": training_job(),
        "gpu-node": gpu_node(),
        "fleet": fleet(),
        "vigil": vigil_self(),
    }
