"""Render/validate summary of helm/vigil: objects per values set and the checks each passed.

    .venv/bin/python bench/helm_render.py

Renders the chart with Helm's engine (helm-python-sdk) for the defaults and every
helm/vigil/ci/*-values.yaml, lints each (--strict), validates every core object with
kubernetes-validate --strict (Kubernetes 1.27 and the newest known schema) and every
ServiceMonitor / PrometheusRule against the vendored prometheus-operator CRDs, and counts the bad
values the schema refuses (tests/helm/test_chart.py's list), and runs checkov's Kubernetes policies
over all renders when .venv/checkov exists (scripts/setup.sh makes it). Render times are medians
of 5 renders with their min-max spread. The last line is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import helm_python as helm

from tests.helm import chart
from tests.helm.test_chart import BAD_VALUES
from tests.helm.test_checkov import SKIPS

REPEATS = 5


def main() -> None:
    rows = []
    for name, values in chart.VALUE_SETS.items():
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            objects = chart.render(values)
            times.append(time.perf_counter() - start)
        checked = {"kubernetes": 0, "crd": 0}
        for obj in objects:
            checked[chart.validate(obj)] += 1
        rows.append(
            {
                "values": name,
                "objects": len(objects),
                "kinds": chart.kinds(objects),
                "lint_findings": len(chart.lint(values)),
                "kubernetes_strict": checked["kubernetes"],
                "crd": checked["crd"],
                "render_ms_median": round(statistics.median(times) * 1000, 1),
                "render_ms_spread": [round(min(times) * 1000, 1), round(max(times) * 1000, 1)],
            }
        )
    refused = 0
    for values, _ in BAD_VALUES:
        try:
            chart.render(values)
        except helm.HelmValuesError:
            refused += 1
    print(f"{'values':<18} {'objects':>7} {'lint':>4} {'k8s':>4} {'crd':>4} {'render ms':>16}")
    for row in rows:
        lo, hi = row["render_ms_spread"]
        print(
            f"{row['values']:<18} {row['objects']:>7} {row['lint_findings']:>4} "
            f"{row['kubernetes_strict']:>4} {row['crd']:>4} "
            f"{row['render_ms_median']:>7} ({lo}-{hi})"
        )
        print(f"{'':<18} {json.dumps(row['kinds'])}")
    print(f"bad values refused by values.schema.json: {refused}/{len(BAD_VALUES)}")
    found: dict[str, Any] = {"failed": [], "passed": 0, "skipped": []}
    if chart.CHECKOV.exists():
        with tempfile.TemporaryDirectory() as folder:
            found = chart.checkov(Path(folder), SKIPS)
        print(
            f"checkov: {found['passed']} passed, {len(found['failed'])} failed, "
            f"{len(found['skipped'])} skipped ({len(SKIPS)} checks skipped for all, with reasons)"
        )
    else:
        print("checkov: not installed in .venv/checkov (bash scripts/setup.sh)")
    print(
        json.dumps(
            {
                "values_sets": len(rows),
                "objects": {row["values"]: row["objects"] for row in rows},
                "validated_kubernetes_strict": sum(row["kubernetes_strict"] for row in rows),
                "validated_crd": sum(row["crd"] for row in rows),
                "kube_versions": list(chart.KUBE_VERSIONS),
                "lint_findings": sum(row["lint_findings"] for row in rows),
                "bad_values_refused": refused,
                "bad_values_tried": len(BAD_VALUES),
                "checkov_passed": found["passed"],
                "checkov_failed": len(found["failed"]),
                "render_ms_median": {row["values"]: row["render_ms_median"] for row in rows},
            }
        )
    )


if __name__ == "__main__":
    main()
