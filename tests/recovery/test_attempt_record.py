"""Every attempt on the record, end to end: a user's SDK-instrumented gloo loop under `vigil run`
(no collector), a rank SIGKILLed; the JSONL files keep both attempts, `vigil analyze` shows the
crash, the restart, the resume step and the steps lost; the console shows rank output by rank.
Also `vigil run --help`'s environment list and the local executor's node diagnostics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from vigil.env import EnvVar
from vigil.recovery import diagnosis, local, placement
from vigil.schema import Verdict

HERE = Path(__file__).parent
VIGIL = [sys.executable, "-m", "vigil"]


def _vigil(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run(
        [*VIGIL, *args],
        env={**{k: v for k, v in os.environ.items() if k != EnvVar.COLLECTOR_URL}, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_killed_rank_and_its_restart_are_on_record_for_vigil_analyze(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed as step 5 begins; checkpoints every 3 steps, so attempt 1 resumes at
    3 and steps 3 and 4, trained before the crash, are trained again: 2 steps lost."""
    job = f"attempts-{uuid.uuid4().hex[:8]}"
    toy, out = tmp_path / "toy", tmp_path / "out"
    toy.mkdir()
    env = {
        "TOY_DIR": str(toy),
        "TOY_STEPS": "8",
        "TOY_STEP_S": "0.2",
        "TOY_CKPT_EVERY": "3",
        "TOY_KILL": "0:1:5",
        EnvVar.OUTPUT_DIR.value: str(out),
    }
    console = _vigil(
        ["run", "--nproc", "2", "--nodes", "2", "--spare", "1", "--job", job,
         "--run-dir", str(tmp_path / "run"), "--snapshot-dir", str(tmp_path / "shm"),
         "--", sys.executable, str(HERE / "sdk_job.py")],
        env, tmp_path,
    )  # fmt: skip
    # The console: each attempt's rank output, prefixed by rank.
    assert "[rank 1] attempt 0 resumes at step 0" in console
    assert "[rank 1] step 4 done" in console
    assert "[rank 0] attempt 1 resumes at step 3" in console
    assert "[rank 1] step 7 done" in console
    # One file per rank per attempt, and the controller's record beside them.
    records = out / job
    names = sorted(p.name for p in records.iterdir())
    assert names == [
        "controller.jsonl",
        "rank-00000.attempt-1.jsonl",
        "rank-00000.jsonl",
        "rank-00001.attempt-1.jsonl",
        "rank-00001.jsonl",
    ]
    report = json.loads(_vigil(["analyze", str(records), "--json"], {}, tmp_path))
    first, second = report["attempts"]
    assert (first["attempt"], first["first_step"]) == (0, 0)
    assert first["crash"]["ranks"] == [1] and first["crash"]["step"] == 5
    assert first["crash"]["exit_code"] == -9
    assert (second["attempt"], second["first_step"], second["last_step"]) == (1, 3, 7)
    restart = second["restart"]
    assert (restart["kind"], restart["resume_step"], restart["steps_lost"]) == ("restart", 3, 2)
    assert restart["recovered_s"] > 0
    crashes = [f for f in report["findings"] if f["kind"] == "crash"]
    assert len(crashes) == 1 and crashes[0]["subjects"]["ranks"] == [1]
    text = _vigil(["analyze", str(records)], {}, tmp_path)
    assert "rank 1 on node-1 was killed by SIGKILL in step 5" in text
    assert "resumed at step 3, 2 step(s) lost (steps 3-4 trained again)" in text


@pytest.mark.e2e
def test_quiet_keeps_rank_output_off_the_console_and_in_the_rank_logs(tmp_path: Path) -> None:
    command = ["--", sys.executable, "-c", "print('hello from a rank')"]
    loud = _vigil(["run", "--nproc", "2", "--job", "loud", *command], {}, tmp_path)
    assert "[rank 0] hello from a rank" in loud and "[rank 1] hello from a rank" in loud
    quiet = _vigil(["run", "--nproc", "1", "--job", "quiet", "--quiet", *command], {}, tmp_path)
    assert "hello" not in quiet
    log = tmp_path / "vigil-runs" / "quiet" / "attempts" / "attempt-0" / "rank-0.log"
    assert log.read_text() == "hello from a rank\n"


def test_run_help_lists_the_ranks_environment_and_where_output_goes(tmp_path: Path) -> None:
    text = _vigil(["run", "--help"], {}, tmp_path)
    for name, _ in local.RANK_ENV:
        assert name in text, name
    for needle in ("new each attempt", "[rank N]", "rank-R.log", "controller.jsonl",
                   "rank-NNNNN.attempt-A.jsonl", "--quiet"):  # fmt: skip
        assert needle in text, needle


def test_rank_env_lists_exactly_what_the_executor_sets(tmp_path: Path) -> None:
    executor = local.LocalExecutor(command=["true"], run_dir=tmp_path, snapshot_root=tmp_path)
    layout = placement.Placement.build(nproc=4, nodes=2)
    env = executor._rank_env(layout, 3, 2, 29500)
    env[EnvVar.EXIT_FILE.value] = "set at launch"
    listed = {n.strip() for name, _ in local.RANK_ENV for n in name.split(",")}
    added = {k for k in env if k not in os.environ or os.environ[k] != env[k]}
    assert added <= listed, added - listed
    assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"], env["MASTER_PORT"]) == (
        "3",
        "1",
        "1",
        "29500",
    )
    assert env[EnvVar.RESTART_COUNT] == "2" and env[EnvVar.NODE] == "node-1"


def test_local_diagnosis_runs_the_quick_suite_for_the_node(tmp_path: Path) -> None:
    """The real `vigil diag --quick` (the CPU suite here): seconds, every result named for the
    simulated node, and no verdict that would cordon a healthy host."""
    executor = local.LocalExecutor(command=["true"], run_dir=tmp_path)
    results = executor.diagnose("node-1", timeout_s=120)
    assert results and {r.node for r in results} == {"node-1"}
    tests = {r.test: r.verdict for r in results}
    assert tests["sdc.mismatches"] is Verdict.PASS
    assert tests["memtest.failing_words"] is Verdict.PASS
    assert diagnosis.worst_verdict(results) is Verdict.PASS


_STAND_IN = """
import os, sys
from vigil import codec, schema
node = sys.argv[sys.argv.index("--node") + 1]
print("not a record")
print(codec.encode_json(schema.DiagResult(node=node, device=os.environ["CUDA_VISIBLE_DEVICES"],
      test="memtest.failing_words", value=3.0, unit="count", verdict=schema.Verdict.FAIL)).decode())
sys.exit(1)
"""


def test_local_diagnosis_pins_the_nodes_devices_and_reports_what_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    executor = local.LocalExecutor(
        command=["true"], run_dir=tmp_path, diag_command=[sys.executable, "-c", _STAND_IN]
    )
    executor.adopt(placement.Placement.build(nproc=4, nodes=2), 0)  # 2 ranks per node
    (result,) = executor.diagnose("node-1", timeout_s=60)
    assert (result.node, result.device, result.verdict) == ("node-1", "0,1", Verdict.FAIL)
    broken = local.LocalExecutor(
        command=["true"],
        run_dir=tmp_path,
        diag_command=[
            sys.executable,
            "-c",
            "import sys; print('no GPU here', file=sys.stderr); sys.exit(3)",
        ],
    )
    with pytest.raises(RuntimeError, match=r"diagnostics of node-0 failed \(exit 3.*no GPU here"):
        broken.diagnose("node-0", timeout_s=60)
    slow = local.LocalExecutor(
        command=["true"],
        run_dir=tmp_path,
        diag_command=[sys.executable, "-c", "import time; time.sleep(5)"],
    )
    with pytest.raises(RuntimeError, match="did not finish in 1 s"):
        slow.diagnose("node-0", timeout_s=1)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_with_a_collector_its_api_returns_the_crash_and_the_restart_record(tmp_path: Path) -> None:
    """The same kill with the job shipping to a collector: the controller posts its crash
    finding and the restart (twice: at relaunch, then with the resume step) and the query API
    returns them; the first step comes from the collector's own step records."""
    import httpx

    from vigil.recovery import demo

    job = f"attempts-c-{uuid.uuid4().hex[:8]}"
    toy = tmp_path / "toy"
    toy.mkdir()
    env = {"TOY_DIR": str(toy), "TOY_STEPS": "8", "TOY_STEP_S": "0.2", "TOY_KILL": "0:1:5"}
    with demo.platform(tmp_path) as url:
        _vigil(
            ["run", "--quiet", "--nproc", "2", "--nodes", "2", "--job", job, "--collector", url,
             "--run-dir", str(tmp_path / "run"), "--output-dir", str(tmp_path / "out"),
             "--snapshot-dir", str(tmp_path / "shm"),
             "--", sys.executable, str(HERE / "sdk_job.py")],
            env, tmp_path,
        )  # fmt: skip
        actions = httpx.get(f"{url}/api/v1/actions", params={"job_id": job}, timeout=10).json()
        findings = httpx.get(f"{url}/api/v1/jobs/{job}/findings", timeout=10).json()
    (restart,) = [a for a in actions if a["kind"] == "restart"]
    assert (restart["state"], restart["attempt"]) == ("succeeded", 1)
    assert (restart["resume_step"], restart["steps_lost"]) == (3, 2)
    crash = next(f for f in findings if f["finding_id"] == restart["finding_id"])
    assert crash["kind"] == "crash" and crash["subjects"]["ranks"] == [1]
    assert crash["step_start"] == 5 and "killed by SIGKILL" in crash["summary"]
    assert restart["recovered_s"] > crash["detected_s"]  # time to recover, from the API alone
    # Without offline records, the job's folder holds only the controller's record.
    assert sorted(p.name for p in (tmp_path / "out" / job).iterdir()) == ["controller.jsonl"]
