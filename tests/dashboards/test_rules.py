"""The committed Prometheus rule files pass `promtool check rules`, and every alert is unit
tested with `promtool test rules` (Debian's promtool): it fires on its fault and stays silent
when healthy; the recording rules compute what the dashboards expect.

The promtool test file is written from the cases below; expected annotations are the rule's own
templates expanded with the alert's labels, so a changed runbook or link is tested as written.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vigil.collector.grafana import rules

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
RULES = sorted((ROOT / "dashboards" / "rules").glob("*.rules.yml"))
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
ALERTS = {a["alert"]: a for a in rules.alert_rules(rules.RuleConfig())}


def _expand(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


def _firing(name: str, labels: dict[str, str]) -> dict[str, Any]:
    alert = ALERTS[name]
    full = {**labels, **alert["labels"]}
    notes = {k: _expand(v, labels) for k, v in alert["annotations"].items()}
    return {"exp_labels": full, "exp_annotations": notes}


def _case(
    name: str, series: list[tuple[str, str]], eval_time: str, firing: list[dict[str, str]]
) -> dict[str, Any]:
    return {
        "interval": "10s",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {
                "eval_time": eval_time,
                "alertname": name,
                "exp_alerts": [_firing(name, labels) for labels in firing],
            }
        ],
    }


HUNG = 'vigil_sdk_hang_suspected{job_id="j1", node="n1", rank="%s"}'
FINDING = 'vigil_collector_findings{job_id="j1", kind="%s", state="%s"}'
REJECTED = 'vigil_collector_rejected_batches_total{reason="%s"}'
CASES = [
    # A rank whose hang flag stays up past `for` fires; its healthy peer does not.
    _case(
        "VigilRankHung",
        [(HUNG % "3", "0 0 1x20"), (HUNG % "0", "0x22")],
        "2m",
        [{"job_id": "j1", "node": "n1", "rank": "3"}],
    ),
    _case("VigilRankHung", [(HUNG % "0", "0x22"), (HUNG % "1", "0 1 0x20")], "2m", []),
    _case(
        "VigilStraggler", [(FINDING % ("straggler", "open"), "0 1x20")], "3m", [{"job_id": "j1"}]
    ),
    # Resolved findings and other kinds stay silent.
    _case(
        "VigilStraggler",
        [(FINDING % ("straggler", "resolved"), "1x20"), (FINDING % ("hang", "open"), "1x20")],
        "3m",
        [],
    ),
    _case("VigilMfuDrop", [(FINDING % ("mfu_drop", "open"), "0 1x20")], "3m", [{"job_id": "j1"}]),
    _case("VigilMfuDrop", [(FINDING % ("mfu_drop", "open"), "0x20")], "3m", []),
    # A job vigil will not restart (the controller's recovery_unsafe finding) until it is fixed.
    _case(
        "VigilRecoveryUnsafe",
        [(FINDING % ("recovery_unsafe", "open"), "0 1x20")],
        "3m",
        [{"job_id": "j1"}],
    ),
    _case("VigilRecoveryUnsafe", [(FINDING % ("recovery_unsafe", "resolved"), "1x20")], "3m", []),
    _case(
        "VigilAgentDown",
        [('up{job="vigil-agent", instance="n1:9400"}', "1 1 0x30")],
        "4m",
        [{"job": "vigil-agent", "instance": "n1:9400"}],
    ),
    _case("VigilAgentDown", [('up{job="vigil-agent", instance="n1:9400"}', "1x30")], "4m", []),
    _case(
        "VigilCollectorDown",
        [('up{job="vigil-collector", instance="c:8470"}', "1 0x30")],
        "4m",
        [{"job": "vigil-collector", "instance": "c:8470"}],
    ),
    _case(
        "VigilCollectorDown", [('up{job="vigil-collector", instance="c:8470"}', "1x30")], "4m", []
    ),
    _case("VigilCollectorRefusingIngest", [(REJECTED % "auth", "0+1x60")], "8m", [{}]),
    # Store failures are the other alert's; a counter standing still is healthy.
    _case(
        "VigilCollectorRefusingIngest",
        [(REJECTED % "store", "0+1x60"), (REJECTED % "decode", "5x60")],
        "8m",
        [],
    ),
    _case("VigilCollectorIngestFailing", [(REJECTED % "store", "0+2x60")], "8m", [{}]),
    _case("VigilCollectorIngestFailing", [(REJECTED % "auth", "0+1x60")], "8m", []),
]

STEP = 'vigil_sdk_step_time_seconds{job_id="j1", node="n1", rank="%d"}'
WAIT = 'vigil_sdk_comm_wait_seconds{job_id="j1", node="n1", rank="%d"}'
RECORDING = {
    "interval": "10s",
    # Ranks 0-2 take 1 s a step, rank 3 takes 2 s; ranks 0-2 wait 0.5 s for rank 3's extra
    # compute (0.5 s more than theirs): compute 0.5, 0.5, 0.5, 1.5 -> 3 ranks <= 1x the median.
    "input_series": [{"series": STEP % r, "values": "1x10"} for r in range(3)]
    + [{"series": STEP % 3, "values": "2x10"}]
    + [{"series": WAIT % r, "values": "0.5x10"} for r in range(4)],
    "promql_expr_test": [
        {
            "expr": rules.STEP_P50,
            "eval_time": "1m",
            "exp_samples": [{"labels": f'{rules.STEP_P50}{{job_id="j1"}}', "value": 1}],
        },
        {
            "expr": rules.STEP_MAX,
            "eval_time": "1m",
            "exp_samples": [{"labels": f'{rules.STEP_MAX}{{job_id="j1"}}', "value": 2}],
        },
        {
            "expr": rules.COMPUTE_P50,
            "eval_time": "1m",
            "exp_samples": [{"labels": f'{rules.COMPUTE_P50}{{job_id="j1"}}', "value": 0.5}],
        },
        {
            "expr": f'{rules.COMPUTE_RATIO_BUCKET}{{le=~"1|2|3|\\\\+Inf"}}',
            "eval_time": "1m",
            "exp_samples": [
                {"labels": f'{rules.COMPUTE_RATIO_BUCKET}{{job_id="j1", le="{le}"}}', "value": v}
                for le, v in (("+Inf", 4), ("1", 3), ("2", 3), ("3", 4))
            ],
        },
    ],
}


def test_every_alert_has_a_fault_and_a_healthy_case() -> None:
    tested = [c["alert_rule_test"][0] for c in CASES]
    for name in ALERTS:
        outcomes = {bool(t["exp_alerts"]) for t in tested if t["alertname"] == name}
        assert outcomes == {True, False}, name
        assert ALERTS[name]["annotations"]["runbook"]
        assert ALERTS[name]["annotations"]["ui"].startswith("http://localhost:8470/ui/")


def test_promtool_checks_the_rule_files() -> None:
    assert len(RULES) == 2
    done = subprocess.run([PROMTOOL, "check", "rules", *map(str, RULES)], capture_output=True)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    spec = {
        "rule_files": [str(p) for p in RULES],
        "evaluation_interval": "10s",
        "tests": [*CASES, RECORDING],
    }
    path = tmp_path / "vigil-rules.test.yml"
    path.write_text(rules.to_yaml(spec) + "\n")
    done = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    assert "SUCCESS" in done.stdout.decode()


def test_promtool_catches_a_wrong_expectation(tmp_path: Path) -> None:
    """The harness can fail: a healthy case expected to fire is reported."""
    wrong = _case(
        "VigilMfuDrop", [(FINDING % ("mfu_drop", "open"), "0x20")], "3m", [{"job_id": "j1"}]
    )
    spec = {"rule_files": [str(p) for p in RULES], "tests": [wrong]}
    path = tmp_path / "wrong.test.yml"
    path.write_text(rules.to_yaml(spec) + "\n")
    done = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, timeout=60)
    assert done.returncode != 0
