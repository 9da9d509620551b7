"""Rank liveness across PID namespaces: the SDK's lock file, the agent's probe, the pid fallback.

A real SDK process (`vigil.agent.init`) holds its rank's lock while it lives; the agent, the
folder expiry and the checkpoint controller judge it by that lock, not by its pid (on Kubernetes
a training pod's pids mean nothing in the agent's namespace). Pages without a lock file (older
SDKs) still fall back to `kill -0`, but never for a pid from another namespace.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vigil import schema
from vigil.agent import config, daemon, progress, rundir, sampler, stacks
from vigil.env import EnvVar
from vigil.recovery import checkpoint_request

FOREIGN_NS = "pid:[4026599999]"  # a PID namespace that is not this process's
BOGUS_PID = 999_999_999  # a pid no process has here
# A JobSet pod name: longer than a folder name may be (64), used as the run id too.
LONG_POD = "trainer-" + "x" * 60 + "-workers-0-3-7k2pq"

_SDK_PROCESS = """
import sys, time
import vigil.agent
session = vigil.agent.init(job="live", collector=None, output_dir=sys.argv[2],
                           progress_dir=sys.argv[1], rank=0, world_size=1, measure_cpu_peak=False)
assert session is not None, "the SDK did not start"
with vigil.agent.step(0, tokens=8):
    pass
print("ready", flush=True)
time.sleep(120)
"""


def _set_pid(page: Path, pid: int) -> None:
    """Overwrite the page meta's pid (magic, version, capacity, slot size, then the pid)."""
    with open(page, "r+b") as f:
        f.seek(20)
        f.write(pid.to_bytes(4, "little"))


def _page(folder: Path, *, pid: int, pid_ns: str, lock: bool) -> Path:
    """A crashed-looking page (COMPUTE, never finished) by `pid` of namespace `pid_ns`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rank-00000.page"
    writer = progress.PageWriter(
        path, job="j", node="n", rank=0, world_size=1, local_rank=0, capacity=16, pid_ns=pid_ns
    )
    writer.progress(schema.RankState.COMPUTE, now_mono=1.0, now_wall=time.time(), step=5)
    writer.close()
    _set_pid(path, pid)
    if lock:
        rundir.lock_path(path).touch()  # left by a process that is gone: nobody holds it
    return path


def _crashes(agent: daemon.Agent) -> list[schema.Finding]:
    agent.poll()
    return [
        r
        for r in agent.queue.drain()
        if isinstance(r, schema.Finding) and r.kind is schema.FindingKind.CRASH
    ]


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def _rank_record(jsonl: Path, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if jsonl.exists():
            for line in jsonl.read_text().splitlines():
                record = json.loads(line)
                if record.get("type") == "rank":
                    return dict(record)
        time.sleep(0.1)
    raise AssertionError(f"no rank record in {jsonl}")


def test_a_live_lock_holder_is_alive_whatever_its_pid_and_gone_the_moment_it_is_killed(
    tmp_path: Path,
) -> None:
    pages, out = tmp_path / "pages", tmp_path / "out"
    env = {**os.environ, EnvVar.RUN_ID: LONG_POD, "POD_NAME": LONG_POD}
    env.pop(EnvVar.POD, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SDK_PROCESS, str(pages), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    cfg = config.AgentConfig(node="n", progress_dir=pages, output_dir=tmp_path, page_ttl_s=1e9)
    agent = daemon.Agent(cfg, gpus=None)
    try:
        assert _readline(proc, 120).strip() == "ready", "the SDK process did not start"
        # The long pod name became a stable, shortened folder name: the SDK started anyway.
        run = rundir.safe_name(LONG_POD)
        assert len(run) <= 64 and run.startswith(LONG_POD[:40]) and run != LONG_POD
        folder = pages / "live" / run
        page, lock = folder / "rank-00000.page", folder / "rank-00000.lock"
        assert page.exists() and rundir.lock_held(lock) is True
        manifest = rundir.read_manifest(folder)
        assert manifest["pod"] == LONG_POD and manifest["pid_ns"] == rundir.pid_namespace()
        assert progress.PageReader(page).pid_ns == rundir.pid_namespace()
        assert _rank_record(out / "live" / "rank-00000.jsonl", 30)["pod"] == LONG_POD

        # As the agent of another PID namespace sees it: the pid names nobody here.
        _set_pid(page, BOGUS_PID)
        assert not rundir.pid_alive(BOGUS_PID)
        assert _crashes(agent) == []
        assert rundir.expire(pages, ttl_s=0, now_s=time.time() + 1e6) == []
        assert checkpoint_request.live_pages(pages, "live") == [page]
        assert checkpoint_request.live_pages(pages, "live", run) == [page]
        assert proc.poll() is None, "the agent's probes disturbed the SDK process"

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # Gone at once: no wait for a pid to be reaped or reused.
        assert rundir.lock_held(lock) is False
        (crash,) = _crashes(agent)
        assert crash.subjects.ranks == [0] and f"pid {BOGUS_PID}" in crash.summary
        assert _crashes(agent) == []  # reported once
        assert checkpoint_request.live_pages(pages, "live") == []
        assert rundir.expire(pages, ttl_s=0, now_s=time.time() + 1e6) == [folder]
        assert not folder.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        agent.flusher.stop()


def test_a_free_lock_means_exited_even_when_the_pid_is_alive_here(tmp_path: Path) -> None:
    """A pid from the training pod's namespace that happens to be a live process here (this
    test's own pid) must not keep a crashed rank alive."""
    root = tmp_path / "pages"
    page = _page(root / "j" / "run", pid=os.getpid(), pid_ns=FOREIGN_NS, lock=True)
    assert rundir.pid_alive(os.getpid())
    assert not rundir.page_alive(page, pid=os.getpid(), pid_ns=FOREIGN_NS)
    # The same verdict from the same namespace: the free lock decides, not the pid.
    assert not rundir.page_alive(page, pid=os.getpid(), pid_ns=rundir.pid_namespace())
    cfg = config.AgentConfig(node="n", progress_dir=root, output_dir=tmp_path, page_ttl_s=1e9)
    agent = daemon.Agent(cfg, gpus=None)
    try:
        (crash,) = _crashes(agent)
        assert crash.subjects.ranks == [0]
    finally:
        agent.flusher.stop()
    assert checkpoint_request.live_pages(root, "j") == []
    assert rundir.expire(root, ttl_s=0, now_s=time.time() + 1e6) == [root / "j" / "run"]


def test_without_a_lock_file_a_foreign_pid_is_never_checked(tmp_path: Path) -> None:
    page = _page(tmp_path / "j" / "run", pid=os.getpid(), pid_ns=FOREIGN_NS, lock=False)
    asked: list[int] = []

    def fallback(pid: int) -> bool:
        asked.append(pid)
        return True

    assert not rundir.page_alive(page, pid=os.getpid(), pid_ns=FOREIGN_NS, alive=fallback)
    assert asked == []
    assert rundir.expire(tmp_path, ttl_s=0, now_s=time.time() + 1e6, alive=fallback) == [
        tmp_path / "j" / "run"
    ]


def test_old_pages_without_a_lock_file_fall_back_to_the_pid(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)  # reaped: its pid is free
    live = _page(tmp_path / "j" / "live", pid=os.getpid(), pid_ns="", lock=False)
    dead = _page(tmp_path / "j" / "dead", pid=child.pid, pid_ns="", lock=False)
    here = _page(
        tmp_path / "k" / "here", pid=os.getpid(), pid_ns=rundir.pid_namespace(), lock=False
    )
    assert rundir.page_alive(live, pid=os.getpid())
    assert rundir.page_alive(here, pid=os.getpid(), pid_ns=rundir.pid_namespace())
    assert not rundir.page_alive(dead, pid=child.pid)
    assert checkpoint_request.live_pages(tmp_path, "j") == [live]
    assert rundir.expire(tmp_path, ttl_s=0, now_s=time.time() + 1e6) == [dead.parent]
    assert live.exists() and here.exists()


def test_the_agents_probe_never_makes_the_sdk_fail_to_take_its_lock(tmp_path: Path) -> None:
    lock = tmp_path / "rank-00000.lock"
    lock.touch()
    probe = os.open(lock, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)  # an agent probing right now (held longer than any probe)
    releaser = threading.Timer(0.2, os.close, args=(probe,))
    releaser.start()
    fd = rundir.hold_lock(lock)
    releaser.join()
    assert fd is not None and rundir.lock_held(lock) is True
    assert rundir.lock_held(lock) is True  # probing twice leaves nothing behind
    # A second live process of the same rank keeps its lock: this one starts without.
    assert rundir.hold_lock(lock, wait_s=0.05) is None
    rundir.drop_lock(fd)
    assert rundir.lock_held(lock) is False
    assert rundir.lock_held(tmp_path / "rank-00001.lock") is None


def test_a_forked_child_does_not_keep_its_parents_lock(tmp_path: Path) -> None:
    """A DataLoader worker forked from a rank must not make the rank look alive after it died."""
    lock = tmp_path / "rank-00000.lock"
    fd = rundir.hold_lock(lock)
    assert fd is not None
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its fork hooks have run): say so, then outlive the parent's lock
        os.write(started_w, b"1")
        time.sleep(5)
        os._exit(0)
    try:
        assert os.read(started_r, 1) == b"1"
        assert rundir.lock_held(lock) is True
        rundir.drop_lock(fd)  # the parent's end
        assert rundir.lock_held(lock) is False
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(started_r)
        os.close(started_w)


# -- the SDK's pod and run id ---------------------------------------------------------------
def test_the_pod_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EnvVar.POD, raising=False)
    monkeypatch.delenv("POD_NAME", raising=False)
    assert config.SdkConfig(job="j", rank=0, world_size=1).pod == ""
    monkeypatch.setenv("POD_NAME", "trainer-0")
    assert config.SdkConfig(job="j", rank=0, world_size=1).pod == "trainer-0"
    monkeypatch.setenv(EnvVar.POD, "explicit-pod")
    assert config.SdkConfig(job="j", rank=0, world_size=1).pod == "explicit-pod"
    assert config.SdkConfig(job="j", rank=0, world_size=1, pod="given").pod == "given"


def test_a_long_run_id_is_shortened_stably_and_a_bad_one_refused() -> None:
    def run_id(value: str) -> str:
        return config.SdkConfig(job="j", rank=0, world_size=1, run_id=value).run_id

    assert run_id("nightly-7") == "nightly-7"
    long = run_id(LONG_POD)
    assert len(long) <= 64 and long == run_id(LONG_POD) == rundir.safe_name(LONG_POD)
    assert long != run_id(LONG_POD[:-1] + "z")  # two pods that differ at the end stay apart
    assert rundir.safe_name(long) == long
    # The launcher's environment gives the same folder as the option.
    env = {EnvVar.RUN_ID: LONG_POD}
    assert rundir.run_id(env, world_size=8, pid=1, pgid=1) == long
    with pytest.raises(ValueError, match="plain folder name"):
        run_id("a/b")


def test_a_pid_of_another_namespace_is_translated_only_when_visible(tmp_path: Path) -> None:
    """An agent with the host's PIDs finds a pod's rank by its namespace and NSpid; one that
    cannot see into the pod's namespace gets None, never a local process with the same number."""
    proc = tmp_path / "proc"

    def process(pid: int, ns: str, nspid: str) -> None:
        (proc / str(pid) / "ns").mkdir(parents=True)
        (proc / str(pid) / "ns" / "pid").symlink_to(ns)  # what readlink shows, as in /proc
        (proc / str(pid) / "status").write_text(f"Name:\tpython\nNSpid:\t{nspid}\nPPid:\t1\n")

    process(4242, FOREIGN_NS, "4242\t7")  # the pod's pid 7, the host's 4242
    process(5151, "pid:[4026588888]", "5151\t7")  # pid 7 of another pod
    process(7, rundir.pid_namespace(), "7")  # the agent's own pid 7
    (proc / "self").mkdir()
    assert rundir.local_pid(7, FOREIGN_NS, proc_root=proc) == 4242
    assert rundir.local_pid(8, FOREIGN_NS, proc_root=proc) is None
    assert rundir.local_pid(7, "pid:[4026577777]", proc_root=proc) is None
    assert rundir.local_pid(os.getpid(), rundir.pid_namespace()) == os.getpid()
    assert rundir.local_pid(os.getpid(), "") == os.getpid()


def test_a_hung_rank_of_another_namespace_gets_no_signal_or_py_spy(tmp_path: Path) -> None:
    """Its pid is no process the agent can see: signalling it (SIGUSR1) or tracing it could hit
    an unrelated local process, so the hang is reported without a dump."""
    root = tmp_path / "pages"
    folder = root / "j" / "pod-0"
    folder.mkdir(parents=True)
    page = folder / "rank-00000.page"
    fd = rundir.hold_lock(rundir.lock_path(page))  # the rank, alive in its own namespace
    assert fd is not None
    writer = progress.PageWriter(
        page, job="j", node="n", rank=0, world_size=1, local_rank=0, capacity=16, pid_ns=FOREIGN_NS
    )
    writer.progress(schema.RankState.COMPUTE, now_mono=100.0, now_wall=time.time(), step=0)
    _set_pid(page, os.getpid())  # coincides with a live process here: must not be signalled
    captured: list[int] = []

    def capture(pid: int, **_: object) -> stacks.Stacks:
        captured.append(pid)
        return stacks.Stacks("py-spy", "wrong process\n")

    mono = [100.0]
    cfg = config.AgentConfig(
        node="n",
        progress_dir=root,
        output_dir=tmp_path,
        min_hang_s=1.0,
        startup_grace_s=5.0,
        use_nvml=False,
    )
    agent = daemon.Agent(cfg, gpus=None, clock=lambda: mono[0], capture=capture)
    try:
        agent.poll()
        mono[0] = 110.0
        (suspect,) = agent.poll()
        assert suspect.snapshot.rank == 0 and captured == []
        (hang,) = [r for r in agent.queue.drain() if isinstance(r, schema.Finding)]
        assert hang.kind is schema.FindingKind.HANG and "stacks by none" in hang.summary
    finally:
        agent.flusher.stop()
        writer.close()
        rundir.drop_lock(fd)


def test_a_rank_starting_up_keeps_its_folder(tmp_path: Path) -> None:
    """Between taking its lock and publishing its page a rank has only its lock file: the last
    rank out of the run and the agent's expiry leave the folder to it."""
    folder = tmp_path / "j" / "run"
    folder.mkdir(parents=True)
    fd = rundir.hold_lock(folder / "rank-00001.lock")
    assert fd is not None
    try:
        assert not rundir.release(folder, own=[])
        assert rundir.expire(tmp_path, ttl_s=0, now_s=time.time() + 1e6) == []
    finally:
        rundir.drop_lock(fd)
    assert rundir.expire(tmp_path, ttl_s=0, now_s=time.time() + 1e6) == [folder]


def _unshare_pid() -> list[str] | None:
    """The `unshare` command line that starts a process in a new PID namespace here, or None."""
    # --kill-child: the process dies with `unshare` (a failed test leaves nothing running).
    for cmd in (
        ["unshare", "--pid", "--fork", "--kill-child"],
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"],
    ):
        try:
            done = subprocess.run([*cmd, "true"], capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0:
            return cmd
    return None


def test_a_rank_in_another_pid_namespace_is_judged_by_its_lock(tmp_path: Path) -> None:
    """A real SDK process in a PID namespace of its own (as a training pod's is): its pid there
    (1) is init's here, yet the agent sees it alive while it runs and gone once it is killed."""
    unshare = _unshare_pid()
    if unshare is None:
        pytest.skip("cannot create a PID namespace here (unshare not permitted)")
    pages, out = tmp_path / "pages", tmp_path / "out"
    env = {**os.environ, EnvVar.RUN_ID: "pod-0", EnvVar.POD: "pod-0"}
    proc = subprocess.Popen(
        [*unshare, sys.executable, "-c", _SDK_PROCESS, str(pages), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    cfg = config.AgentConfig(node="n", progress_dir=pages, output_dir=tmp_path, page_ttl_s=1e9)
    agent = daemon.Agent(cfg, gpus=None)
    try:
        assert _readline(proc, 120).strip() == "ready", "the SDK process did not start"
        page = pages / "live" / "pod-0" / "rank-00000.page"
        reader = progress.PageReader(page)
        pid, pid_ns = reader.pid, reader.pid_ns
        reader.close()
        assert pid == 1 and pid_ns and pid_ns != rundir.pid_namespace()
        assert rundir.pid_alive(pid)  # pid 1 here is another process altogether
        assert _crashes(agent) == []
        assert checkpoint_request.live_pages(pages, "live") == [page]
        host_pid = rundir.local_pid(pid, pid_ns)  # seen from this (the parent) namespace
        assert host_pid is not None and host_pid not in (1, proc.pid)
        os.kill(host_pid, signal.SIGKILL)
        proc.wait(timeout=30)
        (crash,) = _crashes(agent)
        assert crash.subjects.ranks == [0]
        assert checkpoint_request.live_pages(pages, "live") == []
        assert rundir.expire(pages, ttl_s=0, now_s=time.time() + 1e6) == [page.parent]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        agent.flusher.stop()


class _Gpus:
    """Stands in for NVML: no readings; records the ranks the agent offers the pod join."""

    def __init__(self) -> None:
        self.ranks: list[sampler.Owner] = []

    def sample(self) -> list[sampler.Reading]:
        return []

    def owners(
        self, pids: dict[int, sampler.Owner], ranks: list[sampler.Owner]
    ) -> dict[str, sampler.Owner]:
        self.ranks = list(ranks)
        return {}

    def close(self) -> None: ...


def test_the_gpu_pod_join_matches_the_recorded_pod_when_the_folder_name_was_shortened(
    tmp_path: Path,
) -> None:
    """A pod whose name is too long for a folder still gets its GPUs: the join matches the pod
    the SDK recorded in the run's manifest, not the shortened folder name."""
    root = tmp_path / "pages"
    writers = []
    for run, pod in ((rundir.safe_name(LONG_POD), LONG_POD), ("plain-run", "")):
        folder = rundir.run_path(root, "j", run)
        folder.mkdir(parents=True)
        rundir.write_manifest(folder, job="j", run=run, output_dir=None, pod=pod)
        writer = progress.PageWriter(
            folder / "rank-00000.page", job="j", node="n", rank=0, world_size=1, local_rank=0,
            capacity=16, pid_ns=rundir.pid_namespace(),
        )  # fmt: skip
        writer.progress(schema.RankState.COMPUTE, now_mono=1.0, now_wall=time.time(), step=0)
        writers.append(writer)
    gpus = _Gpus()
    cfg = config.AgentConfig(node="n", progress_dir=root, output_dir=tmp_path)
    agent = daemon.Agent(cfg, gpus=gpus)  # type: ignore[arg-type]
    try:
        agent.poll()
        agent.sample()
        assert sorted(owner.run for owner in gpus.ranks) == sorted([LONG_POD, "plain-run"])
    finally:
        agent.flusher.stop()
        for writer in writers:
            writer.close()
