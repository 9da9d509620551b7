"""Per-run progress folders: naming, the clean-shutdown release, the agent's expiry (real files,
fake clocks and liveness), where the agent keeps a hung rank's stacks, and `collector=None`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import vigil.agent
from vigil import schema, spool
from vigil.agent import config, daemon, progress, rundir, sdk, stacks
from vigil.env import EnvVar

DEAD, LIVE = 4_000_001, 4_000_002  # pids the fake liveness calls dead and alive


def _alive(pid: int) -> bool:
    return pid == LIVE


def _page(folder: Path, rank: int, *, pid: int, state: schema.RankState, wall: float) -> Path:
    """A real page whose meta names `pid` (as the process that wrote it would)."""
    path = folder / f"rank-{rank:05d}.page"
    writer = progress.PageWriter(
        path, job="j", node="n", rank=rank, world_size=4, local_rank=rank, capacity=16
    )
    writer.progress(state, now_mono=1.0, now_wall=wall, step=3)
    writer.close()
    raw = bytearray(path.read_bytes())
    raw[20:24] = pid.to_bytes(4, "little")  # the meta block's pid (magic, version, capacity, slot)
    path.write_bytes(bytes(raw))
    assert progress.PageReader(path).pid == pid
    return path


def _spool_with_batch(folder: Path) -> Path:
    box = spool.Spool(folder, max_bytes=1 << 20)
    box.push("b1", 1, b"frame")
    box.close()
    return folder


def _age(folder: Path, seconds: float) -> None:
    """Make every entry's mtime `seconds` old."""
    then = time.time() - seconds
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (then, then))


# -- naming ---------------------------------------------------------------------------------
def test_the_run_id_comes_from_the_launcher_in_a_fixed_order() -> None:
    def run_id(**env: str) -> str:
        return rundir.run_id(env, world_size=2, pid=77, pgid=70)

    full = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}
    assert run_id(**full, VIGIL_RUN_ID="nightly-7") == "nightly-7"
    assert run_id(**full) == "te-abc"
    # torchrun's default rendezvous id is the same for every run: not a run id.
    assert run_id(**{**full, "TORCHELASTIC_RUN_ID": "none"}) == "m-10.0.0.5-29500"
    assert run_id(MASTER_PORT="29500") == "m-localhost-29500"
    assert run_id() == "pg-70"  # ranks forked by one parent share its process group
    assert rundir.run_id({}, world_size=1, pid=77, pgid=70) == "p-77"  # a process alone
    # Two launches on one node differ; the ranks of one agree.
    assert run_id(MASTER_PORT="29500") != run_id(MASTER_PORT="29501")


def test_odd_run_ids_become_one_safe_folder_name() -> None:
    for odd in ("..", ".", "a/b", "x" * 200, "[::1]:29500", "ü"):
        name = rundir.safe_name(odd)
        assert "/" not in name and name not in (".", "..") and 0 < len(name) <= 64
        assert rundir.safe_name(odd) == name  # stable: every rank derives the same
    assert rundir.safe_name("a/b") != rundir.safe_name("a_b")
    ipv6 = rundir.run_id({"MASTER_ADDR": "::1", "MASTER_PORT": "1"}, world_size=2, pid=1, pgid=1)
    assert ipv6.startswith("m-") and ":" not in ipv6


def test_the_root_is_configurable_for_sdk_and_agent_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(EnvVar.PROGRESS_DIR, raising=False)
    assert config.AgentConfig(node="n").progress_dir == Path("/dev/shm/vigil")
    monkeypatch.setenv(EnvVar.PROGRESS_DIR, str(tmp_path / "pages"))
    assert config.AgentConfig(node="n").progress_dir == tmp_path / "pages"
    assert config.SdkConfig(job="j", rank=0, world_size=1).progress_dir == tmp_path / "pages"
    monkeypatch.setenv(EnvVar.PROGRESS_DIR, "rel")  # one meaning whatever a process's cwd
    assert rundir.progress_root() == Path.cwd() / "rel"
    with pytest.raises(ValueError, match="run_id"):
        config.SdkConfig(job="j", rank=0, world_size=1, run_id="a/b")


# -- clean shutdown -------------------------------------------------------------------------
def test_the_last_rank_out_removes_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "j" / "run-1"
    folder.mkdir(parents=True)
    finished = schema.RankState.FINISHED
    mine = _page(folder, 0, pid=DEAD, state=finished, wall=1.0)
    other = _page(folder, 1, pid=LIVE, state=schema.RankState.COMPUTE, wall=1.0)
    (folder / "rank-00000.stacks").write_text("")
    rundir.write_manifest(folder, job="j", run="run-1", output_dir=None)
    # Rank 0 leaves while rank 1 still runs: its files go, the folder stays.
    assert not rundir.release(folder, own=[mine, folder / "rank-00000.stacks"], alive=_alive)
    assert not mine.exists() and other.exists()
    # Rank 1 (now finished) leaves last: the folder and the emptied job folder go.
    _page(folder, 1, pid=DEAD, state=finished, wall=1.0)
    assert rundir.release(folder, own=[other], alive=_alive)
    assert not (tmp_path / "j").exists()


def test_release_keeps_a_crashed_ranks_page_and_unsent_batches(tmp_path: Path) -> None:
    folder = tmp_path / "j" / "run-1"
    folder.mkdir(parents=True)
    crashed = _page(folder, 1, pid=DEAD, state=schema.RankState.IN_COLLECTIVE, wall=1.0)
    mine = _page(folder, 0, pid=DEAD, state=schema.RankState.FINISHED, wall=1.0)
    assert not rundir.release(folder, own=[mine], alive=_alive)
    assert crashed.exists()  # the agent reports it and expires it after its TTL
    crashed.unlink()
    unsent = _spool_with_batch(folder / "rank-00000.spool")
    drained = folder / "rank-00001.spool"
    spool.Spool(drained, max_bytes=1 << 20).close()
    assert not rundir.release(folder, own=[drained, unsent], alive=_alive)
    assert not drained.exists()
    assert [b.batch_id for b in spool.Spool(unsent, max_bytes=1 << 20).pending()] == ["b1"]


def test_a_spool_held_by_a_live_sender_keeps_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "j" / "run-1"
    held = spool.Spool(folder / "rank-00000.spool", max_bytes=1 << 20)  # empty, but locked
    try:
        assert not rundir.release(folder, own=[], alive=_alive)
        assert not rundir.remove_drained_spool(held.directory)
        assert rundir.expire(tmp_path, ttl_s=0, now_s=time.time() + 1e6, alive=_alive) == []
    finally:
        held.close()
    assert rundir.release(folder, own=[], alive=_alive)


def test_a_clean_shutdown_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EnvVar.PROGRESS_DIR, str(tmp_path / "pages"))
    monkeypatch.setenv(EnvVar.RUN_ID, "r-42")
    session = vigil.agent.init(
        job="clean", output_dir=tmp_path / "out", rank=0, world_size=1, measure_cpu_peak=False
    )
    assert session is not None
    folder = tmp_path / "pages" / "clean" / "r-42"
    assert session.page.path == folder / "rank-00000.page"
    assert rundir.read_manifest(folder)["output_dir"] == str(tmp_path / "out" / "clean")
    with vigil.agent.step(0, tokens=4):
        pass
    vigil.agent.shutdown()
    assert list((tmp_path / "pages").iterdir()) == []
    assert (tmp_path / "out" / "clean" / "rank-00000.jsonl").exists()  # the output stays


def test_a_failed_rank_keeps_its_page_for_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EnvVar.RUN_ID, "r-1")
    pages = tmp_path / "pages"
    session = vigil.agent.init(
        job="boom", progress_dir=pages, output_dir=tmp_path, measure_cpu_peak=False
    )
    assert session is not None
    try:
        raise RuntimeError("the loop failed")
    except RuntimeError:
        vigil.agent.shutdown()  # called while the exception is handled: FAILED
    assert session.page.path.exists()
    assert progress.PageReader(session.page.path).snapshot().state is schema.RankState.FAILED


# -- the agent's expiry ---------------------------------------------------------------------
def test_expiry_waits_for_dead_processes_the_ttl_and_replayed_spools(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    dead = root / "j" / "dead"
    live = root / "j" / "live"
    unsent = root / "k" / "unsent"
    for folder in (dead, live, unsent):
        folder.mkdir(parents=True)
    _page(dead, 0, pid=DEAD, state=schema.RankState.COMPUTE, wall=1000.0)
    _page(live, 0, pid=LIVE, state=schema.RankState.COMPUTE, wall=1000.0)
    _spool_with_batch(unsent / "rank-00000.spool")
    own = _spool_with_batch(root / "agent-n.spool")  # the agent's own, at the root
    for folder in (dead, live, unsent):
        _age(folder, 10_000)
    aged = time.time() - 10_000
    assert rundir.expire(root, ttl_s=600, now_s=aged + 500, alive=_alive) == []  # < the TTL
    assert rundir.expire(root, ttl_s=600, now_s=time.time(), alive=_alive, job="k") == []
    assert rundir.expire(root, ttl_s=600, now_s=time.time(), alive=_alive) == [dead]
    assert not (root / "j" / "dead").exists() and live.exists() and unsent.exists()
    assert own.is_dir() and (root / "k" / "unsent" / "rank-00000.spool").is_dir()
    # Once the agent replayed the spool (and removed it), the folder expires too.
    for batch in (box := spool.Spool(unsent / "rank-00000.spool", max_bytes=1 << 20)).pending():
        box.remove(batch)
    assert box.close_and_remove_if_empty()
    _age(unsent, 10_000)
    assert rundir.expire(root, ttl_s=600, now_s=time.time(), alive=_alive) == [unsent]
    assert not (root / "k").exists() and own.is_dir()


def test_recent_activity_holds_off_expiry(tmp_path: Path) -> None:
    folder = tmp_path / "j" / "run"
    folder.mkdir(parents=True)
    _page(folder, 0, pid=DEAD, state=schema.RankState.FINISHED, wall=5000.0)
    _age(folder, 0)
    now = time.time()
    assert rundir.expire(tmp_path, ttl_s=600, now_s=now + 599, alive=_alive) == []
    assert rundir.expire(tmp_path, ttl_s=600, now_s=now + 601, alive=_alive) == [folder]


# -- where the agent keeps stacks -----------------------------------------------------------
def test_a_hung_ranks_stacks_go_to_its_own_run(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs of one job: the hang is in run "b", so run "b"'s output gets the dump (not the
    agent's working directory, not run "a"'s)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("agent-cwd"))  # its own JSON lines go there
    root = tmp_path / "pages"
    mono = [100.0]
    writers = {}
    for run in ("a", "b"):
        folder = rundir.run_path(root, "j", run)
        folder.mkdir(parents=True)
        rundir.write_manifest(folder, job="j", run=run, output_dir=tmp_path / run / "j")
        writer = progress.PageWriter(
            folder / "rank-00000.page", job="j", node="n", rank=0, world_size=1, local_rank=0,
            capacity=16,
        )  # fmt: skip
        writer.progress(schema.RankState.COMPUTE, now_mono=100.0, now_wall=time.time(), step=0)
        writers[run] = writer
    captured: list[int] = []

    def capture(pid: int, **_: object) -> stacks.Stacks:
        captured.append(pid)
        return stacks.Stacks("py-spy", "Thread 1\n  hang_here (job.py:3)\n")

    cfg = config.AgentConfig(
        node="n", progress_dir=root, min_hang_s=1.0, startup_grace_s=5.0, use_nvml=False
    )
    agent = daemon.Agent(cfg, gpus=None, clock=lambda: mono[0], capture=capture)
    try:
        agent.poll()
        mono[0] = 110.0
        # Run a's rank keeps making progress; run b's is stuck.
        writers["a"].progress(
            schema.RankState.COMPUTE, now_mono=110.0, now_wall=time.time(), step=1
        )
        (suspect,) = agent.poll()
        assert suspect.snapshot.path.parent.name == "b" and captured == [os.getpid()]
        (dump,) = (tmp_path / "b" / "j" / "stacks").iterdir()
        assert dump.name.startswith("stacks-b-") and dump.name.endswith("-py-spy-rank-00000.txt")
        assert "hang_here" in dump.read_text()
        assert not (tmp_path / "a" / "j" / "stacks").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "pages"]  # nowhere else
    finally:
        agent.flusher.stop()
        for writer in writers.values():
            writer.close()


def test_without_a_named_output_stacks_stay_with_the_run(tmp_path: Path) -> None:
    folder = tmp_path / "pages" / "j" / "r1"
    folder.mkdir(parents=True)
    assert daemon.stacks_dir(folder, "j", agent_output=None) == folder / "stacks"
    assert daemon.stacks_dir(folder, "j", agent_output=tmp_path) == tmp_path / "j" / "r1" / "stacks"
    rundir.write_manifest(folder, job="j", run="r1", output_dir=tmp_path / "out" / "j")
    assert (
        daemon.stacks_dir(folder, "j", agent_output=tmp_path) == tmp_path / "out" / "j" / "stacks"
    )


# -- collector=None -------------------------------------------------------------------------
def test_collector_none_means_none_and_left_out_means_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EnvVar.COLLECTOR_URL, "http://127.0.0.1:9")
    options = {"output_dir": tmp_path, "progress_dir": tmp_path / "p", "measure_cpu_peak": False}
    session = vigil.agent.init(job="none", collector=None, **options)  # type: ignore[arg-type]
    assert session is not None and session.shipper is None and session.cfg.collector is None
    vigil.agent.shutdown()
    session = vigil.agent.init(job="env", **options)  # type: ignore[arg-type]
    assert session is not None and session.cfg.collector == "http://127.0.0.1:9"
    assert session.shipper is not None
    vigil.agent.shutdown()
    assert repr(sdk.FROM_ENV) == "vigil.agent.sdk.FROM_ENV"
    assert vigil.agent.init(job="x", collector=5, **options) is None  # type: ignore[arg-type]
