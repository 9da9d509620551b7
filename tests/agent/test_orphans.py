"""The end of a run is not lost: a rank that exits while the collector is away leaves its last
batches (the FINISHED heartbeat among them) in its spool, and the node agent replays them once
the collector is back; a second agent never replays them again, and a live rank's spool is
never touched.

The agent replays what an exited `vigil diag` run left in its spool the same way. The rank and
the diag run are real processes that exit; the agents and the collector stand-in run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vigil.agent
from tests.agent import conftest, receiver
from vigil import schema, spool
from vigil.agent import config, daemon, orphans, rundir
from vigil.env import EnvVar

pytestmark = pytest.mark.integration


def _agent(pages: Path, url: str, node: str) -> daemon.Agent:
    cfg = config.AgentConfig(node=node, progress_dir=pages, collector=url, use_nvml=False)
    return daemon.Agent(cfg, gpus=None)


def _orphans(agent: daemon.Agent) -> orphans.OrphanSpools:
    assert agent.orphans is not None
    return agent.orphans


def test_the_agent_replays_an_exited_ranks_spool_once(tmp_path: Path) -> None:
    pages, port, steps = tmp_path / "pages", conftest.free_port(), 12
    url = f"http://127.0.0.1:{port}"  # nobody listens yet: the collector is down at exit
    job = [sys.executable, str(conftest.HERE / "spool_job.py"), url, str(pages), str(steps)]
    env = {**os.environ, EnvVar.RUN_ID: "run-a"}
    subprocess.run(job, check=True, timeout=120, env=env)
    run_folder = pages / "spooljob" / "run-a"
    left = run_folder / "rank-00000.spool"
    assert list(left.glob("*.vgl")), "the rank left nothing in its spool"
    # A clean end removed the page, but not the folder: its spool still holds batches.
    assert not (run_folder / "rank-00000.page").exists()
    assert rundir.expire(pages, ttl_s=0.0, now_s=time.time() + 3600) == []

    first, second = _agent(pages, url, "a"), _agent(pages, url, "b")
    try:
        _orphans(first).tick()  # claims it; the collector is still away
        _orphans(second).tick()  # claimed already: backs off
        assert _orphans(first).pending_batches > 0 and _orphans(second).pending_batches == 0
        collector = receiver.Receiver(port)
        try:
            _orphans(first).tick()
            _orphans(second).tick()
        finally:
            collector.stop()
    finally:
        first.stop()
        second.stop()
    assert _orphans(first).replayed_spools == 1 and _orphans(second).replayed_spools == 0
    assert not left.exists()
    assert len(set(collector.batch_ids)) == len(collector.batch_ids) == collector.requests
    # Replayed: nothing in the folder is in use now, so the agent's sweep removes it.
    assert rundir.expire(pages, ttl_s=0.0, now_s=time.time()) == [run_folder]
    assert not (pages / "spooljob").exists()
    step_records = [r.step for r in collector.records if isinstance(r, schema.StepRecord)]
    assert sorted(step_records) == list(range(steps))
    beats = [r for r in collector.records if isinstance(r, schema.Heartbeat)]
    assert beats[-1].state is schema.RankState.FINISHED


def test_a_live_ranks_spool_is_left_alone(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    url = f"http://127.0.0.1:{conftest.free_port()}"
    session = vigil.agent.init(
        job="live", collector=url, progress_dir=pages, flush_interval_s=0.05, measure_cpu_peak=False
    )
    assert session is not None and session.shipper is not None
    spooled = session.shipper.spool
    collector = receiver.Receiver()
    agent = _agent(pages, collector.url, "a")
    try:
        with vigil.agent.step(0):
            pass
        conftest.poll_until(lambda: len(spooled), timeout_s=10, what="a spooled batch")
        _orphans(agent).tick()
        assert _orphans(agent).pending_batches == 0 and collector.requests == 0
    finally:
        vigil.agent.shutdown()
        agent.stop()
        collector.stop()
    _orphans(agent).tick()  # shut down, but this process (its owner) still runs
    assert collector.requests == 0 and len(spooled) > 0


_DIAG_WHILE_AWAY = """
import sys
from pathlib import Path
from vigil import schema
from vigil.kernels import ship
r = schema.DiagResult(node="n1", device="cpu", test="gemm.fp32.torch", value=1.0)
config = ship.ShipConfig(url=sys.argv[1], spool_dir=Path(sys.argv[2]), attempts=1)
assert ship.send([r], config).delivery == "spooled"
"""


def test_the_agent_replays_what_a_diag_run_left(tmp_path: Path) -> None:
    port = conftest.free_port()
    url, diag = f"http://127.0.0.1:{port}", spool.diag_dir(tmp_path / "data")
    run = [sys.executable, "-c", _DIAG_WHILE_AWAY, url, str(diag)]
    subprocess.run(run, check=True, timeout=120)  # the collector is away; the run exits
    cfg = config.AgentConfig(
        node="a",
        progress_dir=tmp_path / "pages",
        collector=url,
        use_nvml=False,
        replay_dirs=(diag,),
    )
    agent = daemon.Agent(cfg, gpus=None)
    collector = receiver.Receiver(port)
    try:
        _orphans(agent).tick()
    finally:
        agent.stop()
        collector.stop()
    assert [r.test for r in collector.records if isinstance(r, schema.DiagResult)] == [
        "gemm.fp32.torch"
    ]
    assert _orphans(agent).replayed_spools == 1 and not diag.exists()
