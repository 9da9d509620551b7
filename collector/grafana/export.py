"""Write vigil's dashboards, rule files and Grafana provisioning files into a folder.

Layout of `DIR`: `<name>.json` (one per dashboard), `rules/*.rules.yml` (Prometheus rule
files), `provisioning/dashboards/vigil.yaml` (a file dashboard provider reading the JSON from
`dashboards_path`) and `provisioning/datasources/vigil-prometheus.yaml` (the Prometheus data
source). `render` is pure; `write` touches only `DIR`. The repository's `dashboards/` folder is
`render(ExportConfig(dashboards_path=REPO_DASHBOARDS_PATH))`, checked for drift by the tests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from vigil.collector.grafana import builder, dashboards, rules

# Where the repository's committed provisioning file tells Grafana to read the JSON from: the
# folder a container image or a volume mount conventionally uses.
REPO_DASHBOARDS_PATH = "/var/lib/grafana/dashboards/vigil"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
    # Absolute path Grafana reads the dashboard JSON from (None: the export folder itself).
    dashboards_path: str | None = None
    prometheus_url: str = "http://localhost:9090"  # Prometheus' default port
    ui_url: str = builder.DEFAULT_UI
    folder: str = "vigil"  # the Grafana folder the dashboards land in
    agent_job: str = "vigil-agent"  # Prometheus scrape job names the down alerts watch
    collector_job: str = "vigil-collector"

    def __post_init__(self) -> None:
        if self.dashboards_path is not None and not self.dashboards_path.startswith("/"):
            raise ValueError(f"dashboards_path must be absolute, got {self.dashboards_path!r}")
        for name in ("prometheus_url", "ui_url"):
            if not getattr(self, name).startswith(("http://", "https://")):
                raise ValueError(f"{name} must be an http(s) URL, got {getattr(self, name)!r}")
        if not self.folder:
            raise ValueError("folder must not be empty")


def dashboard_json(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, sort_keys=False) + "\n"


def _provider(path: str, folder: str) -> dict[str, Any]:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": "vigil",
                "orgId": 1,
                "folder": folder,
                "folderUid": "vigil",
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 30,
                "options": {"path": path, "foldersFromFilesStructure": False},
            }
        ],
    }


def _datasource(url: str) -> dict[str, Any]:
    return {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "vigil-prometheus",
                "uid": "vigil-prometheus",
                "type": "prometheus",
                "access": "proxy",
                "url": url,
                "isDefault": False,
                "jsonData": {"timeInterval": "15s"},  # the scrape interval: $__rate_interval
            }
        ],
    }


def render(config: ExportConfig, *, folder: Path | None = None) -> dict[str, str]:
    """Relative path -> file text; `folder` stands in for `dashboards_path` when that is None."""
    path = config.dashboards_path or str((folder or Path(".")).resolve())
    files: dict[str, str] = {}
    for stem, value in dashboards.all_dashboards().items():
        if config.ui_url != builder.DEFAULT_UI:
            value = _with_ui(value, config.ui_url)
        files[f"{stem}.json"] = dashboard_json(value)
    rule_config = rules.RuleConfig(
        ui_url=config.ui_url, agent_job=config.agent_job, collector_job=config.collector_job
    )
    for name, groups in rules.rule_groups(rule_config).items():
        files[f"rules/{name}"] = rules.to_yaml(groups) + "\n"
    files["provisioning/dashboards/vigil.yaml"] = (
        rules.to_yaml(_provider(path, config.folder)) + "\n"
    )
    files["provisioning/datasources/vigil-prometheus.yaml"] = (
        rules.to_yaml(_datasource(config.prometheus_url)) + "\n"
    )
    return files


def _with_ui(value: dict[str, Any], ui_url: str) -> dict[str, Any]:
    variables = [
        builder.ui_variable(ui_url) if v["name"] == "vigil_ui" else v
        for v in value["templating"]["list"]
    ]
    return {**value, "templating": {"list": variables}}


def write(folder: Path, config: ExportConfig) -> list[Path]:
    """Write the export into `folder` (created if needed); returns the files written."""
    written = []
    for relative, text in render(config, folder=folder).items():
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(target)
    return written
