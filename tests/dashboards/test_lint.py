"""Structural lint of the generated dashboards, after Grafana's dashboard-linter rules.

No Grafana server exists on these machines: these checks read the JSON the generator writes,
rule by rule as grafana/dashboard-linter names them (template-datasource-rule,
template-job-rule, template-on-time-change-reload-rule, panel-datasource-rule,
panel-title-description-rule, panel-units-rule, panel-no-targets-rule, target-rate-interval-rule,
target-job-rule, target-instance-rule, target-counter-agg-rule), plus vigil's own: stable uids,
allowed panel types, `${vigil_ui}` links on panels that show a job or rank. What each query
returns is checked against a real Prometheus in test_prometheus_e2e.py.

Exemptions, each with its reason, are in EXEMPT below.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.dashboards import promql
from vigil.collector.grafana import builder, dashboards

BOARDS = dashboards.all_dashboards()
ALLOWED = {"timeseries", "heatmap", "status-history", "stat", "table"}
PER_RANK = ("vigil_sdk_", "vigil_gpu_")  # series the node agent exports per rank / GPU
JOB_LEVEL = ("vigil:job_", "vigil_collector_job_", "vigil_collector_findings",
             "vigil_collector_actions", "vigil_collector_checkpoint")  # fmt: skip

# target-job-rule / target-instance-rule name Prometheus' `job` and `instance` labels. In vigil
# the dashboard variable `job` is the training job (label job_id: `job` is Prometheus' scrape
# job), and the node a rank runs on (label node) stands where `instance` would. Exempt:
EXEMPT = {
    # The fleet dashboard shows every job: filtering by one would defeat it.
    ("vigil-fleet", "target-job-rule"): "the fleet view spans all jobs",
    # vigil's own health is per agent and per collector, not per training job.
    ("vigil-self", "target-job-rule"): "agent and collector health belong to no job",
    # Job-level series (recording rules, collector's store-derived series) carry no node or
    # rank: they are aggregated over them.
    ("*", "target-instance-rule:job-level"): "aggregated over nodes and ranks",
    # target-rate-interval-rule: a top-k panel picks its k series once, by their increase over
    # the whole range at its end (`[$__range] @ end()`), and plots `$__rate_interval` rates.
    ("*", "target-rate-interval-rule:top-k selection"): "ranks series over the whole range",
}


def _board_params() -> list[Any]:
    return [pytest.param(board, id=stem) for stem, board in BOARDS.items()]


def test_uids_are_stable_and_distinct() -> None:
    assert {b["uid"] for b in BOARDS.values()} == set(dashboards.UIDS.values())
    assert dashboards.training_job()["uid"] == "vigil-training-job"  # bookmarks survive


@pytest.mark.parametrize("board", _board_params())
def test_classic_json_shape(board: dict[str, Any]) -> None:
    assert board["schemaVersion"] >= 39
    assert board["id"] is None and board["uid"] and board["title"].startswith("vigil / ")
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["type"] in ALLOWED, panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24


@pytest.mark.parametrize("board", _board_params())
def test_template_rules(board: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in board["templating"]["list"]}
    # template-datasource-rule: a datasource variable of type prometheus.
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # template-job-rule (as job) and the brief's namespace / node / rank, plus the UI base URL.
    assert {"namespace", "job", "node", "rank", "vigil_ui"} <= set(variables)
    assert variables["vigil_ui"]["query"] == builder.DEFAULT_UI
    for name in ("namespace", "job", "node", "rank"):
        v = variables[name]
        assert v["datasource"] == builder.DATASOURCE
        # template-on-time-change-reload-rule.
        assert v["refresh"] == 2
        assert v["includeAll"] and v["allValue"] == ".*"
        assert v["definition"].startswith("label_values(")
        for _, matchers in promql.selectors(v["definition"]):
            assert "namespace" in matchers or name == "namespace"


@pytest.mark.parametrize("board", _board_params())
def test_panel_rules(board: dict[str, Any]) -> None:
    for panel in board["panels"]:
        title = panel["title"]
        # panel-datasource-rule.
        assert panel["datasource"] == builder.DATASOURCE, title
        # panel-title-description-rule.
        assert title and len(panel["description"]) > 10, title
        # panel-units-rule.
        assert panel["fieldConfig"]["defaults"]["unit"], title
        # panel-no-targets-rule.
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["datasource"] == builder.DATASOURCE, title
            assert target["expr"].strip(), title


@pytest.mark.parametrize("board", _board_params())
def test_target_rate_interval_and_counter_agg(board: dict[str, Any]) -> None:
    for panel, target in promql.targets(board):
        expr = target["expr"]
        # target-rate-interval-rule: every range function over counters uses $__rate_interval,
        # except the top-k selection over the whole range (EXEMPT: "[$__range] @ end()").
        for window, pinned in re.findall(
            r"(?:rate|increase|irate)\([^\[]*\[([^\]]*)\]( @ end\(\))?", expr
        ):
            ok = window == "$__rate_interval" or (window == "$__range" and pinned)
            assert ok, (panel["title"], expr)
        # target-counter-agg-rule: a counter is only read through rate() or increase().
        for name, _ in promql.selectors(expr):
            if name.endswith(("_total", "_bucket")):
                i = expr.index(name)
                assert re.search(r"(rate|increase)\($", expr[:i]), (panel["title"], expr)


@pytest.mark.parametrize("board", _board_params())
def test_target_job_and_instance_rules(board: dict[str, Any]) -> None:
    uid = board["uid"]
    for panel, target in promql.targets(board):
        for name, matchers in promql.selectors(target["expr"]):
            where = (panel["title"], name)
            assert 'namespace=~"$namespace"' in matchers, where
            job_rule_exempt = (uid, "target-job-rule") in EXEMPT
            if name.startswith(PER_RANK):
                # target-instance-rule, as node and rank.
                assert 'node=~"$node"' in matchers, where
                if not name.startswith("vigil_sdk_") or uid != "vigil-self":
                    assert 'rank=~"$rank"' in matchers, where
            if name.startswith(PER_RANK + JOB_LEVEL) and not job_rule_exempt:
                assert 'job_id=~"$job"' in matchers, where
            if name.startswith("vigil_host_") or name.startswith("vigil_agent_"):
                assert 'node=~"$node"' in matchers or "and on (" in target["expr"], where


@pytest.mark.parametrize("board", _board_params())
def test_panels_showing_a_job_or_rank_link_to_the_ui(board: dict[str, Any]) -> None:
    for panel, target in promql.targets(board):
        legend, expr = target["legendFormat"], target["expr"]
        links = [link["url"] for link in panel["fieldConfig"]["defaults"]["links"]]
        shows_job = "{{job_id}}" in legend or "by (job_id" in expr
        shows_rank = "{{rank}}" in legend
        if shows_job or shows_rank:
            assert links, panel["title"]
            assert all(u.startswith("${vigil_ui}/ui/jobs/${__field.labels.job_id}") for u in links)
        if shows_rank:
            assert any("rank=${__field.labels.rank}" in u for u in links), panel["title"]
        for url in links:
            assert "${vigil_ui}" in url and "__url" not in url


def test_every_panel_of_the_training_dashboard_has_a_ui_link_or_a_reason() -> None:
    board = dashboards.training_job()
    unlinked = [p["title"] for p in board["panels"] if not p["fieldConfig"]["defaults"]["links"]]
    # The heatmap's series are bands of ranks (le buckets), not a job or a rank.
    assert unlinked == ["Ranks by compute time relative to the job median"]
