"""Three real runs of one job name on one node (gloo, 2 ranks each, one launch of six processes):
each run gets its own progress folder, under the root `$VIGIL_PROGRESS_DIR` names, from its
launch's MASTER_ADDR:MASTER_PORT; the node agent watching the root sees all six pages; the two
runs that end cleanly leave nothing behind, and the folder of the run that is killed (SIGKILL)
stays as the agent's crash evidence until its TTL, when the agent removes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agent import conftest
from vigil import schema
from vigil.agent import config, daemon
from vigil.env import EnvVar

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
JOB = "twin"
TTL_S = 600.0


def _launch(
    port: int, root: Path, out: Path, gate: Path, log_dir: Path
) -> list[subprocess.Popen[bytes]]:
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
        }
        env.pop(EnvVar.RUN_ID, None)
        env.pop("TORCHELASTIC_RUN_ID", None)
        log = open(log_dir / f"run{port}-rank{rank}.log", "wb")  # noqa: SIM115 - the child's
        procs.append(
            subprocess.Popen(
                [sys.executable, str(conftest.HERE / "twin_job.py"), str(out), str(gate)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        log.close()
    return procs


def test_runs_of_one_job_keep_apart_and_clean_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, gate = tmp_path / "shm", tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv(EnvVar.PROGRESS_DIR, str(root))  # for the ranks and the agent alike
    ports = [conftest.free_port() for _ in range(3)]
    runs = {p: _launch(p, root, tmp_path / f"out{p}", gate, tmp_path) for p in ports}
    clean, killed = ports[:2], ports[2]
    wall = [time.time()]
    agent = daemon.Agent(
        config.AgentConfig(node="n1", output_dir=tmp_path / "agent-out", page_ttl_s=TTL_S),
        gpus=None,
        wall_clock=lambda: wall[0],
    )
    try:
        ready = conftest.poll_until(
            lambda: sorted(gate.glob("ready-*")) if len(list(gate.glob("ready-*"))) == 6 else None,
            timeout_s=90,
            what="six ranks of three runs to train and park",
        )
        pages = {m.name: Path(m.read_text()) for m in ready}
        # Each run its own folder, named for its launch; its two ranks share it.
        for port in ports:
            folder = root / JOB / f"m-127.0.0.1-{port}"
            assert {pages[f"ready-{port}-{r}"] for r in (0, 1)} == {
                folder / "rank-00000.page",
                folder / "rank-00001.page",
            }
        assert len(list((root / JOB).iterdir())) == 3
        assert agent.cfg.progress_dir == root
        agent.poll()
        assert len(agent.view().ranks) == 6
        for proc in runs[killed]:
            proc.send_signal(signal.SIGKILL)
        (gate / "go").write_text("")
        for port in clean:
            conftest.wait_all(runs[port], timeout_s=60, log_dir=tmp_path)
        for proc in runs[killed]:
            proc.wait(30)
        agent.poll()
        # The clean runs left nothing; the killed run's folder is the agent's evidence.
        assert [p.name for p in (root / JOB).iterdir()] == [f"m-127.0.0.1-{killed}"]
        crashes = [
            r
            for r in agent.queue.drain()
            if isinstance(r, schema.Finding) and r.kind is schema.FindingKind.CRASH
        ]
        assert sorted(c.subjects.ranks[0] for c in crashes) == [0, 1]
        wall[0] += TTL_S - 60  # not yet
        agent.poll()
        assert (root / JOB / f"m-127.0.0.1-{killed}").is_dir()
        wall[0] += 120  # past the TTL of its last progress
        agent.poll()
        assert not root.exists() or list(root.iterdir()) == []
        assert agent.view().ranks == []
    finally:
        for procs in runs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        agent.flusher.stop()
