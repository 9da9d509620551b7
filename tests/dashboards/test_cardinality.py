"""Per-rank cardinality stays bounded: a 10,000-rank job must not cost Prometheus millions of
series. The agent's real exporter is fed 10,000 synthetic ranks (one GPU each) and its series
counted; the count per rank is fixed (nothing is labelled by step, group or op) and every
metric it exports is documented in docs/metrics.md."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from tests.dashboards import synthetic
from vigil.agent import exporter

ROOT = Path(__file__).resolve().parents[2]
RANKS, PER_NODE = 10_000, 8
SDK_PER_RANK, GPU_PER_RANK, PER_NODE_SERIES = 11, 12, 15


def _count(views: list[synthetic.ViewFn]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for view in views:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(exporter.AgentCollector(view))
        for family in registry.collect():
            counts[family.name] = counts.get(family.name, 0) + len(family.samples)
    return counts


def _nodes(step_offset_s: float) -> list[synthetic.ViewFn]:
    started = time.time() - step_offset_s
    return [
        synthetic.node_view(
            job="big", node=f"n{first // PER_NODE}", ranks=list(range(first, first + PER_NODE)),
            world=RANKS, stragglers={7}, started_s=started,
        )
        for first in range(0, RANKS, PER_NODE)
    ]  # fmt: skip


def test_a_10000_rank_job_costs_a_fixed_number_of_series_per_rank() -> None:
    counts = _count(_nodes(5.0))
    sdk = sum(n for name, n in counts.items() if name.startswith("vigil_sdk_"))
    gpu = sum(n for name, n in counts.items() if name.startswith("vigil_gpu_"))
    node = sum(n for name, n in counts.items() if name.startswith(("vigil_host_", "vigil_agent_")))
    assert sdk == SDK_PER_RANK * RANKS
    assert gpu == GPU_PER_RANK * RANKS
    assert node == PER_NODE_SERIES * (RANKS // PER_NODE)
    total = sum(counts.values())
    assert total < 30 * RANKS  # ~250,000, not millions
    # Later steps add no series: nothing is labelled by step.
    assert _count(_nodes(500.0)) == counts


def test_every_exported_metric_is_documented() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    names = _count(_nodes(5.0)[:1])
    for name in names:
        # prometheus-client names counter families without their _total suffix.
        documented = f"`{name}`" in doc or f"`{name}_total`" in doc
        assert documented, name
