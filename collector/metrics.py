"""The collector's own Prometheus metrics, on a registry per app (names from vigil.metric_names).

Ingested rows and rejected batches are counters (rates come from PromQL); batch latency is a
histogram; store size is read from the store at scrape time, and so are the job-level series of
`job_metrics.JobMetrics` (findings, actions, restarts, goodput, ...) when the app hands it a
store reader. Must not touch the global registry.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from vigil.metric_names import MetricKind, Unit, metric_name

SUBSYSTEM = "collector"
# Batch latency spans 1 ms (a heartbeat) to tens of seconds (a 1M-record batch on a busy store).
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _name(name: str, unit: Unit, kind: MetricKind) -> str:
    return metric_name(SUBSYSTEM, name, unit, kind)


class CollectorMetrics:
    def __init__(
        self,
        *,
        store_size: Callable[[], float],
        analyzer_pending: Callable[[], float],
        jobs: Collector | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        if jobs is not None:
            self.registry.register(jobs)
        self.ingested_rows = Counter(
            _name("ingested_rows", Unit.NONE, MetricKind.COUNTER),
            "Records committed to the store, by record type.",
            ["type"],
            registry=self.registry,
        )
        self.batches = Counter(
            _name("batches", Unit.NONE, MetricKind.COUNTER),
            "Batches answered, by outcome (committed, duplicate).",
            ["outcome"],
            registry=self.registry,
        )
        self.rejected_batches = Counter(
            _name("rejected_batches", Unit.NONE, MetricKind.COUNTER),
            "Batches refused with a 4xx, by reason (decode, auth, too_large, store).",
            ["reason"],
            registry=self.registry,
        )
        self.batch_latency = Histogram(
            _name("batch_latency", Unit.SECONDS, MetricKind.HISTOGRAM),
            "Seconds from receiving a batch's body to its commit.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.analyzer_errors = Counter(
            _name("analyzer_errors", Unit.NONE, MetricKind.COUNTER),
            "Streaming-analyzer calls that raised.",
            registry=self.registry,
        )
        self.analyzer_dropped = Counter(
            _name("analyzer_dropped_batches", Unit.NONE, MetricKind.COUNTER),
            "Committed batches the streaming analyzer never saw: its queue was full.",
            registry=self.registry,
        )
        store_gauge = Gauge(
            _name("store_size", Unit.BYTES, MetricKind.GAUGE),
            "Bytes the store occupies (SQLite files or the PostgreSQL database).",
            registry=self.registry,
        )
        store_gauge.set_function(store_size)
        pending = Gauge(
            _name("analyzer_pending", Unit.NONE, MetricKind.GAUGE),
            "Batches waiting for the streaming analyzer.",
            registry=self.registry,
        )
        pending.set_function(analyzer_pending)
