"""Prometheus /metrics for the node agent (prometheus-client's custom Collector contract).

Per rank (labels job_id, rank, node): last step time, MFU, exposed communication wait,
collective time, last step, its tokens, seconds since progress, hang suspicion, SDK errors, drops
and quarantined batches. Per GPU / host: the sampler's readings (GPU ones labelled with the job,
rank and pod using the device). The agent's own health: queue depth, dropped records, ship
errors, spool bytes, hangs detected, quarantined batches, replayed spools of exited ranks, and
the relay's batches and its requests to the collector.
Names come from `vigil.metric_names`; docs/metrics.md lists each with its labels and series per
rank (a fixed number: nothing here is labelled by step, group or op, so a rank costs the same
series however long it trains). Reads an `AgentView` snapshot; never touches pages itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vigil.agent import progress, sampler
from vigil.metric_names import MetricKind, Unit, metric_name

_RANK_LABELS = ["job_id", "rank", "node"]


@dataclasses.dataclass(frozen=True)
class RankView:
    snapshot: progress.PageSnapshot
    progress_age_s: float
    hung: bool


@dataclasses.dataclass(frozen=True)
class AgentView:
    """What the exporter shows; the agent builds a fresh one each poll."""

    node: str
    ranks: list[RankView] = dataclasses.field(default_factory=list)
    readings: list[sampler.Reading] = dataclasses.field(default_factory=list)
    owners: dict[str, sampler.Owner] = dataclasses.field(default_factory=dict)
    queue_depth: int = 0
    dropped_records: int = 0
    ship_errors: int = 0
    shipped_batches: int = 0
    spool_bytes: int = 0
    hangs_detected: int = 0
    quarantined_batches: int = 0
    replayed_spools: int = 0
    relayed_frames: int = 0
    relay_requests: int = 0


def _gauge(name: str, unit: Unit, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(metric_name("sdk", name, unit), doc, labels=labels)


def _counter(subsystem: str, name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    full = metric_name(subsystem, name, Unit.NONE, MetricKind.COUNTER)
    return CounterMetricFamily(full, doc, labels=labels)


_RANK_GAUGES: list[tuple[str, Unit, str, Callable[[RankView], float]]] = [
    (
        "step_time",
        Unit.SECONDS,
        "Duration of the rank's last finished step.",
        lambda r: r.snapshot.last.step_time_s,
    ),
    (
        "mfu",
        Unit.RATIO,
        "Model FLOPs utilisation of the rank's last step.",
        lambda r: r.snapshot.last.mfu,
    ),
    (
        "comm_wait",
        Unit.SECONDS,
        "Exposed communication wait in the rank's last step.",
        lambda r: r.snapshot.last.comm_wait_s,
    ),
    (
        "collective_time",
        Unit.SECONDS,
        "Total collective time in the rank's last step.",
        lambda r: r.snapshot.last.collective_s,
    ),
    ("last_step", Unit.NONE, "The rank's last finished step.", lambda r: r.snapshot.last.step),
    (
        "step_tokens",
        Unit.NONE,
        "Tokens the rank processed in its last finished step (tokens/s = this / step time).",
        lambda r: r.snapshot.last.tokens,
    ),
    (
        "progress_age",
        Unit.SECONDS,
        "Seconds since the rank last made progress.",
        lambda r: r.progress_age_s,
    ),
    (
        "hang_suspected",
        Unit.NONE,
        "1 while the watchdog suspects the rank is hung.",
        lambda r: 1.0 if r.hung else 0.0,
    ),
]

_RANK_COUNTERS: list[tuple[str, str, Callable[[RankView], float]]] = [
    (
        "internal_errors",
        "Errors inside the rank's SDK hooks (training continued).",
        lambda r: r.snapshot.health.internal_errors,
    ),
    (
        "dropped_records",
        "Records the rank's SDK dropped (queue or spool full).",
        lambda r: r.snapshot.health.dropped_records,
    ),
    (
        "quarantined_batches",
        "Batches of the rank's SDK the collector kept refusing (kept in its spool's quarantine/).",
        lambda r: r.snapshot.health.quarantined_batches,
    ),
]


class AgentCollector(Collector):
    def __init__(self, view: Callable[[], AgentView]) -> None:
        self._view = view

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        yield from self._ranks(view)
        yield from self._readings(view)
        yield from self._health(view)

    def _ranks(self, view: AgentView) -> Iterator[Metric]:
        for name, unit, doc, value in _RANK_GAUGES:
            family = _gauge(name, unit, doc, _RANK_LABELS)
            for r in view.ranks:
                family.add_metric(_rank_labels(r), value(r))
            yield family
        for name, doc, count in _RANK_COUNTERS:
            counter = _counter("sdk", name, doc, _RANK_LABELS)
            for r in view.ranks:
                counter.add_metric(_rank_labels(r), count(r))
            yield counter

    def _readings(self, view: AgentView) -> Iterator[Metric]:
        families: dict[str, Any] = {}
        for reading in view.readings:
            family = families.get(reading.metric)
            if family is None:
                labels = ["node", "device", "job_id", "rank", "pod"] if reading.device else ["node"]
                kind = (
                    CounterMetricFamily if reading.kind is MetricKind.COUNTER else GaugeMetricFamily
                )
                family = families[reading.metric] = kind(
                    reading.metric, f"{reading.subsystem} {reading.name}", labels=labels
                )
            if reading.device:
                owner = view.owners.get(reading.device)
                family.add_metric(
                    [
                        view.node,
                        reading.device,
                        owner.job if owner else "",
                        str(owner.rank) if owner else "",
                        owner.pod if owner else "",
                    ],
                    reading.value,
                )
            else:
                family.add_metric([view.node], reading.value)
        yield from families.values()

    def _health(self, view: AgentView) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            metric_name("agent", "queue_depth", Unit.NONE), "Records waiting to be shipped."
        )
        depth.add_metric([], view.queue_depth)
        spool = GaugeMetricFamily(
            metric_name("agent", "spool", Unit.BYTES), "Bytes spooled while the collector is away."
        )
        spool.add_metric([], view.spool_bytes)
        yield depth
        yield spool
        for name, doc, value in (
            (
                "dropped_records",
                "Records the agent dropped (queue or spool full).",
                view.dropped_records,
            ),
            ("ship_errors", "Failed POSTs to the collector.", view.ship_errors),
            ("shipped_batches", "Batches the collector committed.", view.shipped_batches),
            ("hangs_detected", "Hung ranks the watchdog flagged.", view.hangs_detected),
            (
                "quarantined_batches",
                "Batches the collector kept refusing, set aside in a spool's quarantine/.",
                view.quarantined_batches,
            ),
            (
                "replayed_spools",
                "Spools of exited ranks the agent replayed to the collector.",
                view.replayed_spools,
            ),
            (
                "relayed_frames",
                "Batches of this node's ranks the relay answered.",
                view.relayed_frames,
            ),
            (
                "relay_requests",
                "Requests the relay made to the collector for them.",
                view.relay_requests,
            ),
        ):
            counter = _counter("agent", name, doc, [])
            counter.add_metric([], value)
            yield counter


def _rank_labels(r: RankView) -> list[str]:
    return [r.snapshot.job, str(r.snapshot.rank), r.snapshot.node]
