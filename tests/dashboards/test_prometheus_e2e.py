"""Every dashboard query, variables substituted, against a real Prometheus scraping a real job.

One grouped launch: a real `vigil collector` (SQLite, streaming analyzer), a real `vigil agent`
watching the progress pages of a 4-rank gloo job (tests/realjobs, the user-style loop) in which
rank 3 is an injected straggler (4x slower forward from step 8), and Debian's Prometheus on
loopback scraping both every second with vigil's rule files loaded. No Grafana server exists on
these machines: the panels' queries are taken from the generated JSON and sent to Prometheus
as Grafana would, with `$namespace`, `$node`, `$rank` = All (`.*`), `$job` = the job,
`$__rate_interval` = 10s and `$__range` = 1m. Each query must return at least one series, with
the labels its legend names and a value in the panel's expected range; every panel link,
filled in for the series, opens the web UI's job page (served by the same collector).

Series that need hardware absent here come from a synthetic node agent instead: the agent's
own exporter fed by its real NVML sampler over a stand-in NVML (tests/dashboards/synthetic.py),
attributed to the job's four ranks and scraped by the same Prometheus. The panels checked
against it are the GPU ones: GPU utilisation (job mean), GPU utilisation (least busy), SM clock
(slowest), GPU memory used, Power, Temperature, Throttle reasons, ECC errors (uncorrected), XID
events, PCIe receive, PCIe transmit. The restart record (a crash finding, its restart with
time to recover and steps lost, a migration to a spare) and a checkpoint are posted through the
collector's ingest API as the recovery controller and trainer post them; one malformed batch is
posted so the refusal panels have a reason to show. `promtool check metrics` checks every
exposition (agent, synthetic agent, collector).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent import conftest
from tests.dashboards import promql, synthetic
from tests.dashboards.prometheus import Prometheus
from tests.realjobs import launch
from tests.support import processes
from vigil import api, codec, schema
from vigil.collector.grafana import dashboards, rules

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = sorted((ROOT / "dashboards" / "rules").glob("*.rules.yml"))
JOB = "dash-e2e"
NODE = "testnode"
STEPS = 70
VARIABLES = {
    "namespace": ".*",
    "job": JOB,
    "node": ".*",
    "rank": ".*",
    "__rate_interval": "10s",
    "__range": "1m",
}
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
Result = list[dict[str, Any]]


@dataclass
class Scene:
    base: Path
    collector_url: str = ""
    exposition: dict[str, str] = field(default_factory=dict)
    results: dict[tuple[str, str], list[Result]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _value(series: dict[str, Any]) -> float:
    return float(series["value"][1])


def _post(url: str, body: bytes) -> int:
    headers = {"content-type": api.BATCH_MEDIA_TYPE}
    return httpx.post(url + api.INGEST_PATH, content=body, headers=headers, timeout=10).status_code


def _recovery_records(now: float) -> list[schema.Record]:
    """What the recovery controller posts for a crash it recovered from (the restart record)."""
    crash = schema.Finding(
        finding_id=f"{JOB}-crash-r2", kind=schema.FindingKind.CRASH, job_id=JOB,
        subjects=schema.Subjects(ranks=[2]), detected_s=now - 30.0,
        state=schema.FindingState.RESOLVED,
    )  # fmt: skip
    restart = schema.Action(
        action_id=f"{crash.finding_id}/0-restart", kind=schema.ActionKind.RESTART, job_id=JOB,
        finding_id=crash.finding_id, state=schema.ActionState.SUCCEEDED, start_s=now - 28.0,
        end_s=now - 25.0, attempt=1, resume_step=4, steps_lost=3, recovered_s=now - 20.0,
    )  # fmt: skip
    migrate = schema.Action(
        action_id=f"{crash.finding_id}/1-migrate", kind=schema.ActionKind.MIGRATE, job_id=JOB,
        target="node-bad", state=schema.ActionState.SUCCEEDED, start_s=now - 19.0, end_s=now - 18.0,
    )  # fmt: skip
    checkpoint = schema.Checkpoint(job_id=JOB, step=5, location="/ckpt/5", blocked_s=0.4)
    return [crash, restart, migrate, checkpoint]


Json = dict[str, Any]


def _check_target(
    prom: Prometheus, board: Json, panel: Json, target: Json
) -> tuple[Result, list[str]]:
    expr = promql.substitute(target["expr"], VARIABLES)
    where = f"{board['uid']} / {panel['title']} / {target['refId']}: {expr}"
    result = prom.query(expr)
    problems = []
    if not result:
        return result, [f"{where}: no series"]
    wanted = set(re_labels(target["legendFormat"]))
    for series in result:
        missing = wanted - set(series["metric"])
        if missing:
            problems.append(f"{where}: series {series['metric']} lacks {missing}")
        value = _value(series)
        low, high = RANGES.get(panel["fieldConfig"]["defaults"]["unit"], (0.0, math.inf))
        if not (math.isfinite(value) and low <= value <= high):
            problems.append(f"{where}: value {value} outside [{low}, {high}]")
    return result, problems


def re_labels(legend: str) -> list[str]:
    return re.findall(r"\{\{(\w+)\}\}", legend)


RANGES = {
    "percentunit": (0.0, 1.0),
    "s": (0.0, 600.0),
    "none": (0.0, 1e4),
    "short": (0.0, 1e7),
    "bytes": (0.0, 2**50),
    "Bps": (0.0, 1e12),
    "hertz": (1e8, 5e9),
    "watt": (1.0, 2000.0),
    "celsius": (10.0, 120.0),
}


def _check_all(prom: Prometheus, scene: Scene) -> list[str]:
    problems: list[str] = []
    for board in dashboards.all_dashboards().values():
        for panel in board["panels"]:
            results = []
            for target in panel["targets"]:
                result, found = _check_target(prom, board, panel, target)
                results.append(result)
                problems += found
            scene.results[(board["uid"], panel["title"])] = results
    return problems


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    scene = Scene(tmp_path_factory.mktemp("dash"))
    base, pages, out = scene.base, scene.base / "pages", scene.base / "out"
    port, metrics_port = conftest.free_port(), conftest.free_port()
    scene.collector_url = url = f"http://127.0.0.1:{port}"
    collector = processes.start(
        [sys.executable, "-m", "vigil", "collector", "--host", "127.0.0.1", "--port", str(port),
         "--store", f"sqlite:///{base / 'collector.sqlite3'}"],
        base / "collector.log", {"VIGIL_DATA_DIR": str(base / "data")},
    )  # fmt: skip
    agent = processes.start(
        [sys.executable, "-m", "vigil", "agent", "--node", NODE, "--progress-dir", str(pages),
         "--output-dir", str(out), "--collector", url, "--metrics-port", str(metrics_port),
         "--poll-interval", "0.2", "--sample-interval", "1", "--no-nvml"],
        base / "agent.log",
    )  # fmt: skip
    gpus = synthetic.Exporter(
        synthetic.gpu_view(NODE, [(JOB, r, f"{JOB}-worker-{r}") for r in range(4)], throttled=True)
    )
    prom = Prometheus(
        base,
        {
            "vigil-agent": [f"127.0.0.1:{metrics_port}", gpus.target],
            "vigil-collector": [f"127.0.0.1:{port}"],
        },
        rule_files=RULE_FILES,
    )
    done: list[launch.Launch] = []
    fault = {"kind": "slow", "rank": 3, "factor": 4.0, "where": "forward"}
    cases = [{"job": JOB, "steps": STEPS, "seed": 5, "fault": fault}]
    runner = threading.Thread(
        target=lambda: done.append(
            launch.launch("plain", cases, out, nproc=4, collector=url, progress_dir=pages,
                          env={"NODE_NAME": NODE}, timeout_s=180)
        )
    )  # fmt: skip
    try:
        conftest.poll_until(lambda: _healthy(url), timeout_s=60, what="the collector")
        runner.start()
        conftest.poll_until(
            lambda: _open_straggler(url) or (not runner.is_alive() and "job ended"),
            timeout_s=120,
            what="the straggler finding",
        )
        assert runner.is_alive(), "the job ended before the straggler was found"
        assert _post(url, codec.encode_batch(_recovery_records(time.time()))) == 200
        assert 400 <= _post(url, b"VGL\x00not a batch") < 500  # a refusal, reason decode
        deadline = time.monotonic() + 60
        while True:
            scene.failures = _check_all(prom, scene)
            if not scene.failures or time.monotonic() > deadline or not runner.is_alive():
                break
            time.sleep(2)
        for name, target in (("agent", f"127.0.0.1:{metrics_port}"), ("synthetic", gpus.target),
                             ("collector", f"127.0.0.1:{port}")):  # fmt: skip
            scene.exposition[name] = httpx.get(f"http://{target}/metrics", timeout=10).text
        yield scene
    finally:
        runner.join(200)
        prom.stop()
        gpus.close()
        processes.stop(agent)
        processes.stop(collector)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _open_straggler(url: str) -> bool:
    try:
        found = httpx.get(f"{url}/api/v1/jobs/{JOB}/findings", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(f["kind"] == "straggler" and f["state"] == "open" for f in found)


def test_every_panel_query_returns_series_in_range(scene: Scene) -> None:
    assert scene.failures == []
    count = sum(
        len(p["targets"]) for b in dashboards.all_dashboards().values() for p in b["panels"]
    )
    assert sum(len(r) for r in scene.results.values()) == count


def _first(scene: Scene, uid: str, title: str) -> Result:
    return scene.results[(dashboards.UIDS[uid], title)][0]


def test_the_straggler_stands_out(scene: Scene) -> None:
    top = _first(scene, "training-job", "Slowest 10 ranks: compute time")
    assert max(top, key=_value)["metric"]["rank"] == "3", top
    ratios = _first(scene, "training-job", "Slowest 10 ranks over time (compute / job median)")
    worst = max(ratios, key=_value)
    assert worst["metric"]["rank"] == "3" and _value(worst) > 1.5, ratios
    heatmap = _first(scene, "training-job", "Ranks by compute time relative to the job median")
    bands = {s["metric"]["le"]: _value(s) for s in heatmap}
    ordered = [bands[le] for le in rules.RATIO_BOUNDS]
    assert ordered == sorted(ordered) and bands["+Inf"] == 4, bands  # a histogram of 4 ranks
    # Half the ranks at most at the median; the straggler (3-4x its peers' compute) far above.
    assert bands["1"] >= 2 and bands["+Inf"] - bands["1.5"] >= 1, bands
    findings = _first(scene, "training-job", "Open findings by kind")
    assert {s["metric"]["kind"] for s in findings} >= {"straggler"}


def test_recovery_panels_show_the_restart_record(scene: Scene) -> None:
    assert _value(_first(scene, "training-job", "Restarts")[0]) == 2  # restart + migrate
    assert _value(_first(scene, "training-job", "Steps lost")[0]) == 3
    assert _value(_first(scene, "training-job", "Time to recover")[0]) == pytest.approx(10, abs=0.5)
    assert _value(_first(scene, "fleet", "Nodes excluded by recovery")[0]) == 1
    assert _value(_first(scene, "fleet", "Spares taken")[0]) == 1
    assert _value(_first(scene, "fleet", "Jobs running")[0]) >= 1
    refused = _first(scene, "vigil", "Collector refusals and failures")
    assert {s["metric"]["reason"] for s in refused} == {"decode"}
    assert _value(_first(scene, "vigil", "Agents reporting")[0]) == 1  # the real agent


def test_gpu_panels_attribute_the_synthetic_gpus_to_the_job(scene: Scene) -> None:
    slowest = _first(scene, "gpu-node", "SM clock (slowest)")
    assert min(_value(s) for s in slowest) == 1.41e9  # the throttled GPU 0, on rank 0
    assert {s["metric"]["rank"] for s in slowest} == {"0", "1", "2", "3"}
    assert {s["metric"]["job_id"] for s in slowest} == {JOB}
    throttle = _first(scene, "gpu-node", "Throttle reasons")
    assert max(_value(s) for s in throttle) == 64  # HW thermal slowdown
    hosts = _first(scene, "gpu-node", "Host CPU")
    assert {s["metric"]["node"] for s in hosts} == {NODE}


def test_panel_links_open_the_job_page(scene: Scene) -> None:
    for board in dashboards.all_dashboards().values():
        for panel in board["panels"]:
            for link in panel["fieldConfig"]["defaults"]["links"]:
                values = {"vigil_ui": scene.collector_url, "__field.labels.job_id": JOB,
                          "__field.labels.rank": "3", "__value.raw": "12"}  # fmt: skip
                url = promql.substitute(link["url"], values)
                assert url.startswith(f"{scene.collector_url}/ui/jobs/{JOB}"), url
                assert httpx.get(url, timeout=10).status_code == 200, url


@pytest.mark.parametrize("name", ["agent", "synthetic", "collector"])
def test_promtool_checks_every_exposition(scene: Scene, name: str) -> None:
    text = scene.exposition[name]
    assert "vigil_" in text
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
