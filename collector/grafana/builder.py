"""Grafana dashboard JSON as plain Python data: panels, targets, variables, links, layout.

Classic dashboard JSON (schemaVersion 39), the form Grafana's provisioning, its HTTP API and the
sidecar ConfigMaps all load. Every panel and target names the `${datasource}` variable; every
data link points at the vigil web UI under the `${vigil_ui}` variable. Pure: builds dicts, does
no I/O, and knows nothing of which metrics exist (dashboards.py holds the queries).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DEFAULT_UI = "http://localhost:8470"  # the collector's default port, which serves the web UI
PANEL_TYPES = ("timeseries", "heatmap", "status-history", "stat", "table")
WIDTH = 24  # Grafana's grid is 24 columns wide

Json = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False  # one value per series (stat, table) instead of a range
    table: bool = False  # format "table" (table panels); else time series
    heatmap: bool = False  # format "heatmap" (le buckets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Panel:
    kind: str
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    width: int = 12
    height: int = 8
    # UI deep link for each series, e.g. "metric=step_time&rank=${__field.labels.rank}";
    # None: the panel shows no job, rank or step (node and vigil health panels).
    link: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    stacked: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PANEL_TYPES:
            raise ValueError(f"panel {self.title!r}: type {self.kind!r} not in {PANEL_TYPES}")
        if not self.unit:
            raise ValueError(f"panel {self.title!r} has no unit")
        if not self.description:
            raise ValueError(f"panel {self.title!r} has no description")
        if not self.queries:
            raise ValueError(f"panel {self.title!r} has no query")
        if not 1 <= self.width <= WIDTH:
            raise ValueError(f"panel {self.title!r}: width {self.width} outside 1..{WIDTH}")


def job_link(query: str = "") -> str:
    """The UI's job page for the series' job, with optional query parameters."""
    url = "${vigil_ui}/ui/jobs/${__field.labels.job_id}"
    return f"{url}?{query}" if query else url


def _target(query: Query, ref: str) -> Json:
    target: Json = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": query.expr,
        "legendFormat": query.legend or "__auto",
        "refId": ref,
        "range": not query.instant,
        "instant": query.instant,
    }
    if query.table:
        target["format"] = "table"
    elif query.heatmap:
        target["format"] = "heatmap"
    return target


def _options(panel: Panel) -> Json:
    legend = {"displayMode": "table", "placement": "right", "showLegend": True, "calcs": ["last"]}
    tooltip = {"mode": "multi", "sort": "desc"}
    if panel.kind == "timeseries":
        return {"legend": legend, "tooltip": tooltip}
    if panel.kind == "status-history":
        return {"showValue": "never", "rowHeight": 0.9, "colWidth": 0.9, "legend": legend,
                "tooltip": tooltip}  # fmt: skip
    if panel.kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "area", "textMode": "auto",
                "justifyMode": "auto", "orientation": "auto"}  # fmt: skip
    if panel.kind == "heatmap":
        return {"calculate": False, "yAxis": {"axisPlacement": "left", "unit": panel.unit},
                "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                "rowsFrame": {"layout": "le"}, "tooltip": {"mode": "single", "yHistogram": True},
                "legend": {"show": True}}  # fmt: skip
    return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}


def _field_config(panel: Panel) -> Json:
    defaults: Json = {"unit": panel.unit, "links": []}
    if panel.minimum is not None:
        defaults["min"] = panel.minimum
    if panel.maximum is not None:
        defaults["max"] = panel.maximum
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
        }
    if panel.link is not None:
        defaults["links"] = [
            {"title": "Open in vigil", "url": panel.link, "targetBlank": True},
        ]
    return {"defaults": defaults, "overrides": []}


def render_panels(panels: list[Panel]) -> list[Json]:
    """Panels laid out left to right, top to bottom, with ids 1.. in order."""
    out, x, y, row_h = [], 0, 0, 0
    for index, panel in enumerate(panels, start=1):
        if x + panel.width > WIDTH:
            x, y, row_h = 0, y + row_h, 0
        refs = [chr(ord("A") + i) for i in range(len(panel.queries))]
        rendered: Json = {
            "id": index,
            "type": panel.kind,
            "title": panel.title,
            "description": panel.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
            "fieldConfig": _field_config(panel),
            "options": _options(panel),
            "targets": [_target(q, r) for q, r in zip(panel.queries, refs, strict=True)],
        }
        if panel.kind == "table" and len(panel.queries) > 1:
            rendered["transformations"] = [{"id": "merge", "options": {}}]
        out.append(rendered)
        x, row_h = x + panel.width, max(row_h, panel.height)
    return out


def datasource_variable() -> Json:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def ui_variable(default: str = DEFAULT_UI) -> Json:
    return {
        "name": "vigil_ui",
        "label": "vigil UI",
        "description": "Base URL of the vigil web UI (the collector) that panel links open.",
        "type": "textbox",
        "query": default,
        "current": {"text": default, "value": default},
        "options": [{"selected": True, "text": default, "value": default}],
        "hide": 0,
    }


def query_variable(name: str, label: str, metric: str, label_name: str) -> Json:
    """A multi-value variable of a label's values; All matches any value, or none (".*")."""
    definition = f"label_values({metric}, {label_name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": definition,
        "query": {"qryType": 1, "query": definition, "refId": "PrometheusVariableQueryEditor"},
        "refresh": 2,  # on time-range change: jobs come and go
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 3,  # numerically ascending (ranks)
        "hide": 0,
    }


def dashboard(
    *,
    uid: str,
    title: str,
    description: str,
    variables: list[Json],
    panels: list[Panel],
    links: list[Json],
) -> Json:
    return {
        "id": None,
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["vigil"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": links,
        "templating": {"list": variables},
        "panels": render_panels(panels),
    }
