"""The fleet and vigil-itself dashboards: every job the collector follows, and the health of
vigil's own parts (agents, SDKs, collector, analyzer). Pure data, as dashboards.py."""

from __future__ import annotations

from vigil.collector.grafana import builder, rules
from vigil.collector.grafana.builder import Json, Panel, Query, job_link
from vigil.collector.grafana.panels import (
    NS,
    RANK,
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


def fleet() -> Json:
    coll = f"{{{NS}}}"
    running = f"(vigil_collector_job_running{coll} == 1)"
    goodput = f"vigil_collector_job_goodput_ratio{coll}"
    running_at_end = f"(vigil_collector_job_running{coll} @ end() == 1)"
    panels = [
        stat(
            "Jobs running",
            "Jobs whose rank 0 heartbeat reached the collector in the last minute.",
            "short",
            Query(expr=f"sum(vigil_collector_job_running{coll})", instant=True),
        ),
        stat(
            "Nodes excluded by recovery",
            "Nodes recovery cordoned or moved jobs off (succeeded cordon / migrate actions).",
            "short",
            Query(expr=f"sum(vigil_collector_job_nodes_excluded{coll})", instant=True),
        ),
        stat(
            "Spares taken",
            "Migrations of a job onto a spare node that succeeded.",
            "short",
            Query(
                expr=f'sum(vigil_collector_actions{{{NS}, kind="migrate", state="succeeded"}})',
                instant=True,
            ),
        ),
        stat(
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
        ts(
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
        ts(
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
        ts(
            "Recovery actions by kind and state",
            "Actions the recovery controller recorded.",
            "short",
            Query(
                expr=f"sum by (kind, state) (vigil_collector_actions{coll})",
                legend="{{kind}} {{state}}",
            ),
            minimum=0,
        ),
        ts(
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
        ts(
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
        variables=variables(),
        panels=panels,
        links=links(),
    )


def _agent(title: str, desc: str, unit: str, expr: str) -> Panel:
    return ts(title, desc, unit, Query(expr=expr, legend="{{instance}}"), minimum=0)


def vigil_self() -> Json:
    # Agent health series carry the scrape target's labels only: the agent's host series (same
    # instance) say which node it is.
    on_node = f'and on (instance) vigil_host_memory_used_bytes{{{NS}, node=~"$node"}}'
    coll = f"{{{NS}}}"
    rejected = "vigil_collector_rejected_batches_total"
    latency = f"sum by (le) (rate(vigil_collector_batch_latency_seconds_bucket{coll}[{RI}]))"
    panels = [
        stat(
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
        ts(
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
        ts(
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
        ts(
            "Collector batch latency",
            "Seconds from a batch's body to its commit (p50, p99).",
            "s",
            Query(expr=f"histogram_quantile(0.5, {latency})", legend="p50"),
            Query(expr=f"histogram_quantile(0.99, {latency})", legend="p99"),
            minimum=0,
        ),
        ts(
            "Collector batches by outcome",
            "Batches answered per second: committed, duplicate.",
            "short",
            Query(
                expr=f"sum by (outcome) (rate(vigil_collector_batches_total{coll}[{RI}]))",
                legend="{{outcome}}",
            ),
            minimum=0,
        ),
        ts(
            "Collector refusals and failures",
            "Batches refused per second by reason (decode, auth, too_large: 4xx; store: 503).",
            "short",
            Query(expr=f"sum by (reason) (rate({rejected}{coll}[{RI}]))", legend="{{reason}}"),
            minimum=0,
        ),
        ts(
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
        ts(
            "Collector store",
            "Bytes the store occupies; seconds the job metrics' refresh took.",
            "bytes",
            Query(expr=f"max(vigil_collector_store_size_bytes{coll})", legend="store"),
            minimum=0,
        ),
        ts(
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
        variables=variables(nodes=f"vigil_host_memory_used_bytes{{{NS}}}"),
        panels=panels,
        links=links(),
    )
