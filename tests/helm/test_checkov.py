"""checkov's Kubernetes policies pass on helm/vigil's render in every tested values set.

checkov lives in its own environment (.venv/checkov, made by scripts/setup.sh): its pins
(packaging, networkx) would downgrade what vigil's environment installs. Findings the chart
accepts are skipped either here, for every object, or by `checkov.io/skipN` annotations on the one
object they concern (the agent's root user and capabilities, the controller's API token and
missing probes, the test Pod's); each with its reason.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.helm import chart

CHECKOV = chart.CHECKOV
CHECKOV_VERSION = "3.3.30"

# Skipped for every object, with the reason.
SKIPS = {
    # Digests are a value (image.digest, ci/air-gapped-values.yaml); no image is published to pin.
    "CKV_K8S_43": "image digest is optional",
    # With tags, IfNotPresent is the default; image.pullPolicy sets Always where wanted.
    "CKV_K8S_15": "pull policy is a value",
    # No CPU limits: CFS throttling stalls the collector's ingest and the agent's sampling; CPU
    # requests are set, memory limits too.
    "CKV_K8S_11": "CPU limits deliberately unset",
    # vigil reads its tokens and store URL from VIGIL_* variables (pydantic settings), not files.
    "CKV_K8S_35": "secrets as env vars by design",
    # Which traffic to allow (agents on every node to the collector, Prometheus to both) is the
    # cluster's network policy to write; the chart ships none.
    "CKV2_K8S_6": "NetworkPolicy is cluster-specific",
}


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    if not chart.CHECKOV.exists():
        pytest.skip("checkov is not installed in .venv/checkov (bash scripts/setup.sh installs it)")
    return chart.checkov(tmp_path_factory.mktemp("render"), SKIPS)


def test_checkov_is_the_pinned_version() -> None:
    if not CHECKOV.exists():
        pytest.skip("checkov is not installed in .venv/checkov (bash scripts/setup.sh installs it)")
    done = subprocess.run([CHECKOV, "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == CHECKOV_VERSION


def test_checkov_finds_nothing_beyond_the_listed_skips(findings: dict[str, object]) -> None:
    assert findings["failed"] == []
    assert isinstance(findings["passed"], int) and findings["passed"] > 500


def test_the_per_object_skips_concern_only_their_objects(findings: dict[str, object]) -> None:
    skipped = findings["skipped"]
    assert isinstance(skipped, list)
    by_check: dict[str, set[str]] = {}
    for check, resource in skipped:
        by_check.setdefault(check, set()).add(resource.split(".")[0] + "." + resource.split(".")[2])
    assert by_check["CKV_K8S_23"] == {"DaemonSet.vigil-agent"}  # root: the agent only
    assert by_check["CKV_K8S_17"] == {"DaemonSet.vigil-agent"}  # hostPID: with stack dumps
    assert by_check["CKV_K8S_38"] <= {
        "Deployment.vigil-controller-llama-pretrain",
        "Deployment.vigil-controller-bert-finetune",
        "Pod.vigil-test",
    }
