"""What vigil's dashboards share: the variable matchers, top-k selection over the whole time
range, panel shorthands, the variables and the links. Pure data, as builder.py."""

from __future__ import annotations

from vigil.collector.grafana import builder
from vigil.collector.grafana.builder import Json, Panel, Query

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
    """`fn` of `expr` over the dashboard's range, at its end; a subquery (one point per
    `$__rate_interval`, so a range of any length has a few) when `expr` is not a selector."""
    window = f"[{RANGE}:{RI}]" if subquery else f"[{RANGE}]"
    return f"{fn}({expr}{window} @ end())"


UIDS = {
    "training-job": "vigil-training-job",
    "gpu-node": "vigil-gpu-node",
    "fleet": "vigil-fleet",
    "vigil": "vigil-self",
}


def ts(
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


def stat(title: str, desc: str, unit: str, query: Query, *, link: str | None = None) -> Panel:
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


def variables(*, nodes: str = f"vigil_sdk_last_step{{{JOB}}}") -> list[Json]:
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


def links() -> list[Json]:
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
