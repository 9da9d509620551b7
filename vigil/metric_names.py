"""The one place Prometheus metric names are built and checked: `vigil_<subsystem>_<name>_<unit>`.

Units are Prometheus base units (seconds, bytes, ratio, ...); counters end in `_total`. Every
exporter (node agent, collector) builds its names here, so dashboards and docs can trust them.
Pure string logic: no prometheus_client import, no registry.
"""

from __future__ import annotations

import enum
import re

_WORD = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")


class Unit(enum.StrEnum):
    SECONDS = "seconds"
    BYTES = "bytes"
    RATIO = "ratio"  # 0..1, e.g. MFU, utilization
    CELSIUS = "celsius"
    WATTS = "watts"
    HERTZ = "hertz"
    JOULES = "joules"
    BYTES_PER_SECOND = "bytes_per_second"
    FLOPS = "flops"  # floating-point operations per second
    INFO = "info"  # an info-style gauge whose value is 1 and whose labels carry the data
    NONE = ""  # a dimensionless count or gauge (e.g. queue depth, rows)


class MetricKind(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    SUMMARY = "summary"


def metric_name(subsystem: str, name: str, unit: Unit, kind: MetricKind = MetricKind.GAUGE) -> str:
    """Build `vigil_<subsystem>_<name>[_<unit>][_total]`; raise ValueError on a bad part."""
    for label, part in (("subsystem", subsystem), ("name", name)):
        if not _WORD.match(part):
            raise ValueError(f"metric {label} {part!r} must be lower_snake_case (a-z, 0-9, _)")
    unit = Unit(unit)
    if unit and (name.endswith(f"_{unit.value}") or name == unit.value):
        raise ValueError(f"metric name {name!r} already ends in its unit {unit.value!r}")
    if name.endswith("_total"):
        raise ValueError(f"metric name {name!r} must not end in _total; pass kind=COUNTER")
    full = f"vigil_{subsystem}_{name}"
    if unit:
        full += f"_{unit.value}"
    if kind is MetricKind.COUNTER:
        full += "_total"
    return full
