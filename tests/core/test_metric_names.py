"""Prometheus metric names follow vigil_<subsystem>_<name>_<unit>[_total]."""

from __future__ import annotations

import pytest

from vigil.metric_names import MetricKind, Unit, metric_name


def test_builds_names_with_unit_and_counter_suffix() -> None:
    assert metric_name("agent", "step_time", Unit.SECONDS) == "vigil_agent_step_time_seconds"
    assert metric_name("agent", "mfu", Unit.RATIO) == "vigil_agent_mfu_ratio"
    assert (
        metric_name("collector", "ingested_rows", Unit.NONE, MetricKind.COUNTER)
        == "vigil_collector_ingested_rows_total"
    )
    assert (
        metric_name("agent", "shipped", Unit.BYTES, MetricKind.COUNTER)
        == "vigil_agent_shipped_bytes_total"
    )


@pytest.mark.parametrize(
    ("subsystem", "name", "unit", "needle"),
    [
        ("Agent", "x", Unit.NONE, "lower_snake_case"),
        ("agent", "step-time", Unit.SECONDS, "lower_snake_case"),
        ("agent", "step_time_seconds", Unit.SECONDS, "already ends in its unit"),
        ("agent", "drops_total", Unit.NONE, "kind=COUNTER"),
    ],
)
def test_bad_parts_are_refused(subsystem: str, name: str, unit: Unit, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        metric_name(subsystem, name, unit)
