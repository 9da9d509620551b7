"""The committed `dashboards/` folder is exactly what the generator writes (drift check).

Regenerates into a temp dir (through `vigil dashboards export`, as a user would) and compares
file by file with the repository's copy; any difference, missing or stale file fails, naming it
and the command that refreshes the folder.
"""

from __future__ import annotations

from pathlib import Path

from vigil import cli
from vigil.collector.grafana import export

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "dashboards"
REFRESH = f"vigil dashboards export dashboards --dashboards-path {export.REPO_DASHBOARDS_PATH}"
GENERATED = ("*.json", "rules/*.yml", "provisioning/*/*.yaml")


def _files(folder: Path) -> dict[str, str]:
    found = {}
    for pattern in GENERATED:
        for path in folder.glob(pattern):
            found[str(path.relative_to(folder))] = path.read_text()
    return found


def test_committed_dashboards_match_the_generator(tmp_path: Path) -> None:
    out = tmp_path / "export"
    code = cli.main(
        ["dashboards", "export", str(out), "--dashboards-path", export.REPO_DASHBOARDS_PATH]
    )
    assert code == 0
    fresh, committed = _files(out), _files(COMMITTED)
    assert sorted(committed) == sorted(fresh), f"files differ; run: {REFRESH}"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"{stale} out of date; run: {REFRESH}"


def test_export_points_provisioning_at_the_folder_it_wrote(tmp_path: Path) -> None:
    code = cli.main(["dashboards", "export", str(tmp_path), "--prometheus", "http://prom:9090"])
    assert code == 0
    provider = (tmp_path / "provisioning/dashboards/vigil.yaml").read_text()
    assert f'path: "{tmp_path.resolve()}"' in provider
    source = (tmp_path / "provisioning/datasources/vigil-prometheus.yaml").read_text()
    assert 'url: "http://prom:9090"' in source and 'type: "prometheus"' in source
    assert len(list(tmp_path.glob("*.json"))) == 4


def test_export_takes_the_ui_url_and_scrape_jobs(tmp_path: Path) -> None:
    args = ["--ui", "https://vigil.example", "--agent-job", "node-agents"]
    assert cli.main(["dashboards", "export", str(tmp_path), *args]) == 0
    alerts = (tmp_path / "rules/vigil-alerts.rules.yml").read_text()
    assert 'up{job=\\"node-agents\\"} == 0' in alerts
    assert "https://vigil.example/ui/jobs/{{ $labels.job_id }}" in alerts
    board = (tmp_path / "training-job.json").read_text()
    assert '"query": "https://vigil.example"' in board
    assert cli.main(["dashboards", "export", str(tmp_path), "--agent-job", 'a"b']) == 1
