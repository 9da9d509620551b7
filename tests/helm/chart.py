"""Render, lint and validate helm/vigil with Helm's own engine (helm-python-sdk), offline.

Shared by tests/helm and bench/helm_render.py: `render` returns the rendered objects of one values
set, `validate_core` checks a core object against Kubernetes' OpenAPI schemas (kubernetes-validate,
strict: unknown fields are errors) and `validate_custom` a ServiceMonitor / PrometheusRule against
the prometheus-operator CRDs vendored in tests/helm/crds (with unknown fields refused too, where
the API server would silently prune them).
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "vigil"
CRDS = Path(__file__).resolve().parent / "crds"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema known.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
RELEASE = "vigil"
NAMESPACE = "vigil-system"

# checkov runs from an environment of its own (scripts/setup.sh; its pins conflict with vigil's).
CHECKOV = ROOT / ".venv" / "checkov" / "bin" / "checkov"

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# Every values set the chart is tested with: the defaults and each ci/*-values.yaml.
VALUE_SETS: dict[str, dict[str, Any]] = {"default": {}} | {
    p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text()) or {} for p in CI_VALUES
}

helm.disable_logging()


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render_files(values: dict[str, Any]) -> dict[str, str]:
    return chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects one `helm install` with these values creates (test hooks included)."""
    objects = []
    for path, text in sorted(render_files(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def notes(values: dict[str, Any]) -> str:
    return next(t for p, t in render_files(values).items() if p.endswith("NOTES.txt"))


def lint(values: dict[str, Any]) -> list[str]:
    """`helm lint --strict` findings (warnings and errors), as text."""
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    messages = [m for m in report.get("messages") or [] if m.get("severity", 0) >= 2]
    return [f"{m.get('path')}: {m.get('error')}" for m in messages] + list(
        report.get("errors") or []
    )


def validate_core(obj: dict[str, Any]) -> None:
    """Raise kubernetes_validate.ValidationError when `obj` breaks the schema of any supported
    Kubernetes version."""
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever the CRD lists its fields."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@functools.cache
def _crd_validator(filename: str) -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((CRDS / filename).read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _closed(served["schema"]["openAPIV3Schema"])
    # The API server checks metadata itself; the CRD leaves it open.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft202012Validator(schema)


def validate_custom(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when a monitoring object breaks its CRD's schema."""
    filename = CUSTOM_KINDS[(obj["apiVersion"], obj["kind"])]
    _crd_validator(filename).validate(obj)


def validate(obj: dict[str, Any]) -> str:
    """Validate one rendered object with the right schema; which one checked it."""
    if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
        validate_custom(obj)
        return "crd"
    validate_core(obj)
    return "kubernetes"


def kinds(objects: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for obj in objects:
        counts[obj["kind"]] = counts.get(obj["kind"], 0) + 1
    return dict(sorted(counts.items()))


def summary() -> dict[str, Any]:
    """Per values set: objects rendered, by kind, and how many passed which validation."""
    out: dict[str, Any] = {}
    for name, values in VALUE_SETS.items():
        objects = render(values)
        checked = {"kubernetes": 0, "crd": 0}
        for obj in objects:
            checked[validate(obj)] += 1
        out[name] = {
            "objects": len(objects),
            "kinds": kinds(objects),
            "lint_findings": len(lint(values)),
            "validated_kubernetes_strict": checked["kubernetes"],
            "validated_crd": checked["crd"],
        }
    return out


def checkov(folder: Path, skips: dict[str, str]) -> dict[str, Any]:
    """checkov's Kubernetes policies over every values set's render (written under `folder`):
    the failed checks as text, the number passed, and the (check, object) pairs skipped."""
    for name, values in VALUE_SETS.items():
        Path(folder, f"{name}.yaml").write_text(yaml.safe_dump_all(render(values)))
    done = subprocess.run(
        [
            CHECKOV,
            "--directory",
            str(folder),
            "--framework",
            "kubernetes",
            "--skip-check",
            ",".join(skips),
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [
        f"{f['check_id']} {f['resource']} ({Path(f['file_path']).name}): {f['check_name']}"
        for r in reports
        for f in r["results"].get("failed_checks", [])
    ]
    skipped = [
        (f["check_id"], f["resource"])
        for r in reports
        for f in r["results"].get("skipped_checks", [])
    ]
    passed = sum(r["summary"]["passed"] for r in reports)
    return {"failed": failed, "passed": passed, "skipped": skipped}


if __name__ == "__main__":
    print(json.dumps(summary(), indent=2))
