"""Prometheus rule files: per-job recording rules and vigil's alerts, as data and as YAML.

Recording rules turn per-rank series into per-job ones (`by (namespace, job_id)`), so job-level
panels read a handful of series however many ranks a job has. Alerts: a hung rank, an open
straggler or MFU-drop finding, an agent or the collector down, the collector refusing or failing
ingest; each carries a runbook line and a link into the vigil web UI. Pure: returns data and
text, writes nothing (export.py does).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from vigil.collector.grafana import builder

BY_JOB = "by (namespace, job_id)"
STEP_TIME = "vigil_sdk_step_time_seconds"
COMM_WAIT = "vigil_sdk_comm_wait_seconds"


def compute(selector: str = "") -> str:
    """A rank's compute time: its step minus the communication it waited for (a straggler's
    own step time equals its peers', who wait for it; its compute time stands out)."""
    return f"({STEP_TIME}{selector} - {COMM_WAIT}{selector})"


# Recording rules (names follow Prometheus' level:metric:operations convention).
STEP_P50 = "vigil:job_step_time_seconds:p50"
STEP_P99 = "vigil:job_step_time_seconds:p99"
STEP_MAX = "vigil:job_step_time_seconds:max"
COMPUTE_P50 = "vigil:job_compute_seconds:p50"
COMPUTE_RATIO_BUCKET = "vigil:job_compute_ratio:bucket"
MFU_AVG = "vigil:job_mfu_ratio:avg"
MFU_MIN = "vigil:job_mfu_ratio:min"
TOKENS = "vigil:job_tokens_per_second:sum"
COMM_SHARE = "vigil:job_comm_wait_share:p50"
RANKS = "vigil:job_ranks:count"
HUNG = "vigil:job_hung_ranks:sum"
PROGRESS_AGE = "vigil:job_progress_age_seconds:max"
GPU_UTIL = "vigil:job_gpu_utilization_ratio:avg"
# Upper bounds of the compute-time heatmap: a rank's compute time over its job's median.
RATIO_BOUNDS = ("0.9", "1", "1.05", "1.1", "1.25", "1.5", "2", "3", "+Inf")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuleConfig:
    ui_url: str = builder.DEFAULT_UI  # where alert links point: the vigil web UI
    agent_job: str = "vigil-agent"  # Prometheus scrape job of the node agents
    collector_job: str = "vigil-collector"  # ... and of the collector

    def __post_init__(self) -> None:
        if not self.ui_url.startswith(("http://", "https://")):
            raise ValueError(f"ui_url must be an http(s) URL, got {self.ui_url!r}")
        for name in ("agent_job", "collector_job"):
            if not getattr(self, name) or '"' in getattr(self, name):
                raise ValueError(f"{name} must be a non-empty scrape job name without quotes")


def recording_rules() -> list[dict[str, Any]]:
    per_rank_ratio = f"{compute()} / on (namespace, job_id) group_left {COMPUTE_P50}"
    rules: list[dict[str, Any]] = [
        {"record": STEP_P50, "expr": f"quantile {BY_JOB} (0.5, {STEP_TIME})"},
        {"record": STEP_P99, "expr": f"quantile {BY_JOB} (0.99, {STEP_TIME})"},
        {"record": STEP_MAX, "expr": f"max {BY_JOB} ({STEP_TIME})"},
        {"record": COMPUTE_P50, "expr": f"quantile {BY_JOB} (0.5, {compute()})"},
    ]
    rules += [
        {
            "record": COMPUTE_RATIO_BUCKET,
            "expr": f"sum {BY_JOB} ({per_rank_ratio} <= bool {bound.lstrip('+')})",
            "labels": {"le": bound},
        }
        for bound in RATIO_BOUNDS
    ]
    rules += [
        {"record": MFU_AVG, "expr": f"avg {BY_JOB} (vigil_sdk_mfu_ratio)"},
        {"record": MFU_MIN, "expr": f"min {BY_JOB} (vigil_sdk_mfu_ratio)"},
        {
            "record": TOKENS,
            "expr": f"sum {BY_JOB} (vigil_sdk_step_tokens / ({STEP_TIME} > 0))",
        },
        {
            "record": COMM_SHARE,
            "expr": f"quantile {BY_JOB} (0.5, {COMM_WAIT} / ({STEP_TIME} > 0))",
        },
        {"record": RANKS, "expr": f"count {BY_JOB} (vigil_sdk_last_step)"},
        {"record": HUNG, "expr": f"sum {BY_JOB} (vigil_sdk_hang_suspected)"},
        {"record": PROGRESS_AGE, "expr": f"max {BY_JOB} (vigil_sdk_progress_age_seconds)"},
        {"record": GPU_UTIL, "expr": f'avg {BY_JOB} (vigil_gpu_utilization_ratio{{job_id!=""}})'},
    ]
    return rules


def _alert(
    name: str,
    expr: str,
    *,
    hold: str,
    severity: str,
    summary: str,
    runbook: str,
    ui: str,
) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": hold,
        "labels": {"severity": severity, "service": "vigil"},
        "annotations": {"summary": summary, "runbook": runbook, "ui": ui},
    }


def alert_rules(config: RuleConfig) -> list[dict[str, Any]]:
    job_page = config.ui_url.rstrip("/") + "/ui/jobs/{{ $labels.job_id }}"
    jobs_list = config.ui_url.rstrip("/") + "/ui/"
    open_finding = 'max by (job_id) (vigil_collector_findings{{kind="{}", state="open"}}) > 0'
    refused = 'sum(rate(vigil_collector_rejected_batches_total{reason!="store"}[5m])) > 0'
    failing = 'sum(rate(vigil_collector_rejected_batches_total{reason="store"}[5m])) > 0'
    return [
        _alert(
            "VigilRankHung",
            "max by (namespace, job_id, node, rank) (vigil_sdk_hang_suspected) == 1",
            hold="30s",
            severity="critical",
            summary="Rank {{ $labels.rank }} of job {{ $labels.job_id }} on {{ $labels.node }} "
            "has made no progress past its learned hang threshold.",
            runbook="Open the job page: the hang finding names the culprit rank and its stack; "
            "the recovery controller restarts the job once the hang is confirmed "
            "(vigil agent --request dump_stacks --job JOB for fresh stacks).",
            ui=job_page + "?rank={{ $labels.rank }}",
        ),
        _alert(
            "VigilStraggler",
            open_finding.format("straggler"),
            hold="1m",
            severity="warning",
            summary="Job {{ $labels.job_id }} has an open straggler finding.",
            runbook="The finding names the slow ranks and their evidence (compute, data or "
            "link); check those nodes' GPU clocks and throttling on the GPU and node "
            "dashboard, run vigil diag on them, or let recovery move them to a spare.",
            ui=job_page + "?metric=compute",
        ),
        _alert(
            "VigilMfuDrop",
            open_finding.format("mfu_drop"),
            hold="1m",
            severity="warning",
            summary="Job {{ $labels.job_id }}'s MFU dropped (an open mfu_drop finding).",
            runbook="The finding attributes the drop (straggler, throttling, communication or "
            "data stall): follow its evidence on the job page's MFU view.",
            ui=job_page + "?metric=mfu",
        ),
        _alert(
            "VigilRecoveryUnsafe",
            open_finding.format("recovery_unsafe"),
            hold="1m",
            severity="warning",
            summary="vigil will not restart job {{ $labels.job_id }}: it lacks what a safe "
            "restart needs (an open recovery_unsafe finding).",
            runbook="The finding's evidence names each missing precondition (a JobSet's "
            "podFailurePolicy, failurePolicy rule or backoffLimit; a Kueue-managed TrainJob); "
            "add them (README, Recovery on Kubernetes) and restart vigil controller.",
            ui=job_page,
        ),
        _alert(
            "VigilAgentDown",
            f'up{{job="{config.agent_job}"}} == 0',
            hold="2m",
            severity="warning",
            summary="The vigil node agent at {{ $labels.instance }} is not answering scrapes.",
            runbook="Ranks on that node keep training and spool locally; restart the agent "
            "(systemd unit or DaemonSet pod) and check its log; its spool replays on start.",
            ui=jobs_list,
        ),
        _alert(
            "VigilCollectorDown",
            f'up{{job="{config.collector_job}"}} == 0',
            hold="2m",
            severity="critical",
            summary="The vigil collector at {{ $labels.instance }} is not answering scrapes.",
            runbook="Senders spool while it is away; check its log and store (vigil collector "
            "logs the store URL and schema at start) and restart it.",
            ui=jobs_list,
        ),
        _alert(
            "VigilCollectorRefusingIngest",
            refused,
            hold="2m",
            severity="warning",
            summary="The collector is refusing batches (4xx: decode, auth or size).",
            runbook="See vigil_collector_rejected_batches_total by reason on the vigil "
            "dashboard: auth = a sender's token is wrong, decode = a sender newer than the "
            "collector (upgrade collectors first), too_large = raise the batch limit; refused "
            "batches are quarantined in the senders' spools.",
            ui=jobs_list,
        ),
        _alert(
            "VigilCollectorIngestFailing",
            failing,
            hold="2m",
            severity="critical",
            summary="The collector answers 503 to ingest: its store is failing.",
            runbook="Senders retry and spool; check the store (disk space, SQLite locks, "
            "PostgreSQL up) in the collector's log.",
            ui=jobs_list,
        ),
    ]


def rule_groups(config: RuleConfig) -> dict[str, dict[str, Any]]:
    """File name -> Prometheus rule file contents."""
    return {
        "vigil-recording.rules.yml": {
            "groups": [{"name": "vigil-job-aggregates", "rules": recording_rules()}]
        },
        "vigil-alerts.rules.yml": {
            "groups": [{"name": "vigil-alerts", "rules": alert_rules(config)}]
        },
    }


def to_yaml(value: Any, indent: int = 0) -> str:
    """YAML for dicts, lists, strings and numbers; strings double-quoted (JSON escapes are YAML)."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{key}:\n{to_yaml(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return "\n".join(lines)
    if isinstance(value, list):
        lines = []
        for item in value:
            body = to_yaml(item, indent + 2)
            lines.append(f"{pad}- {body.lstrip()}")
        return "\n".join(lines)
    return pad + _scalar(value)


def _scalar(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict | list):
        return "{}" if isinstance(value, dict) else "[]"
    return json.dumps(str(value))
