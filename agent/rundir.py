"""Per-run progress folders: where a run's pages live, how they are named, when they go away.

Layout under the progress root (`$VIGIL_PROGRESS_DIR`, else /dev/shm/vigil):

    <root>/<job>/<run id>/rank-NNNNN.page     each local rank's progress page (`progress.py`)
                          rank-NNNNN.lock     held (flock) by the rank's process while it lives
                          rank-NNNNN.stacks   its faulthandler stack dumps
                          rank-NNNNN.spool/   its undelivered batches (with a collector)
                          run.json            job, run id, the run's output folder (for the agent)

One folder per run, not per job: two runs of one job on a node (a re-run while the old one
drains, a test beside a demo) never share pages, stacks or spools. Every rank of one run on one
node must land in the same folder (the node agent reads them together), so the run id comes from
what a launcher gives all of a run's ranks alike and no other run at the same time (`run_id`).

Clean-up: a rank that finishes cleanly removes its own files, and the last one out removes the
folder (`release`); a folder still holding a live process's page, a crashed rank's page (the
agent's evidence), or a spool with batches in it is left for the node agent, which removes it
once nothing in it is in use and its last activity is older than its TTL (`expire`). A spool
with batches is never removed here: the agent replays it first (`orphans.py`).

Liveness (`page_alive`): each SDK process holds an exclusive `flock` on its rank's lock file
from before its page is first visible until its page is gone; the kernel drops it when the
process dies however it dies (SIGKILL, the OOM killer). The agent asks whether it is held with a
non-blocking shared lock it drops at once; unlike a pid, that answer means the same in every PID
namespace sharing the folder's filesystem (a Kubernetes hostPath, tmpfs). Pages without a lock
file (written before there were any) fall back to `kill -0` on the page's pid, and only when the
page's PID namespace is this process's own (or unrecorded): a pid from another namespace says
nothing here.

File handling only (no torch, no threads, no network); the pid fallback is a parameter.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from vigil import schema, spool
from vigil.agent import pagelayout, progress
from vigil.env import EnvVar

log = logging.getLogger(__name__)

# /dev/shm is RAM-backed on Linux, so a wedged process's last page write is visible to the agent
# immediately and the page costs no disk I/O.
DEFAULT_ROOT = Path("/dev/shm/vigil")
MANIFEST = "run.json"
STACKS_SUFFIX = ".stacks"
LOCK_SUFFIX = ".lock"
_SAFE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
# How long a starting SDK retries its lock while an agent's probe holds it (microseconds each).
_LOCK_WAIT_S = 2.0
# torchrun's --rdzv-id when none is given (static rendezvous): the same for every run.
_TORCHELASTIC_UNSET = "none"


def progress_root(environ: Mapping[str, str] | None = None) -> Path:
    """The progress root: `$VIGIL_PROGRESS_DIR` (made absolute), else /dev/shm/vigil."""
    env = os.environ if environ is None else environ
    value = env.get(EnvVar.PROGRESS_DIR, "").strip()
    return Path(value).absolute() if value else DEFAULT_ROOT


def safe_name(text: str) -> str:
    """`text` as one folder name: kept when plain, else its plain characters and a hash."""
    if _SAFE.fullmatch(text):
        return text
    digest = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", text).strip(".")[:48]
    return f"{plain}-{digest}" if plain else digest


def is_plain(text: str) -> bool:
    """True for a name of folder-safe characters, whatever its length (`safe_name` shortens)."""
    return _PLAIN.fullmatch(text) is not None


def run_id(
    environ: Mapping[str, str],
    *,
    world_size: int,
    pid: int,
    pgid: int,
) -> str:
    """The run id every rank of one run on one node derives alike, and no concurrent run shares.

    In order: `$VIGIL_RUN_ID` (a launcher's own name for the run); torchrun's
    `$TORCHELASTIC_RUN_ID` (its rendezvous id, when one was given: `--standalone` makes a fresh
    one); `$MASTER_ADDR`/`$MASTER_PORT` (two live runs cannot share a rendezvous store's
    address, and `vigil run` picks a fresh port per attempt); a single process alone, its pid;
    else the process group (ranks forked by `torch.multiprocessing.spawn` share their parent's).
    """
    explicit = environ.get(EnvVar.RUN_ID, "").strip()
    if explicit:
        return safe_name(explicit)
    elastic = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic != _TORCHELASTIC_UNSET:
        return safe_name(f"te-{elastic}")
    port = environ.get("MASTER_PORT", "").strip()
    if port:
        return safe_name(f"m-{environ.get('MASTER_ADDR', '').strip() or 'localhost'}-{port}")
    if world_size == 1:
        return f"p-{pid}"
    return f"pg-{pgid}"


def run_path(root: Path, job: str, run: str) -> Path:
    return Path(root) / job / run


def job_runs(root: Path, job: str) -> list[Path]:
    """The run folders of `job` under `root`, oldest first."""
    folder = Path(root) / job
    if not folder.is_dir():
        return []
    runs = [p for p in folder.iterdir() if p.is_dir()]
    return sorted(runs, key=pagelayout.mtime)


def make_dir(path: Path) -> None:
    """`mkdir -p` that survives another run removing the (empty) job folder meanwhile."""
    for _ in range(5):
        try:
            path.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:  # a parent went between its creation and ours
            continue
    path.mkdir(parents=True, exist_ok=True)


# -- the run manifest -----------------------------------------------------------------------
def write_manifest(
    folder: Path, *, job: str, run: str, output_dir: Path | None, pod: str = ""
) -> None:
    """What the node agent needs to know about the run: where its output (and stacks) go, the
    pod it runs in (Kubernetes; "" elsewhere) and the PID namespace its pids belong to."""
    body = {
        "job": job,
        "run_id": run,
        "output_dir": str(output_dir.absolute()) if output_dir is not None else None,
        "pod": pod or None,
        "pid_ns": pid_namespace() or None,
    }
    tmp = folder / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, folder / MANIFEST)  # every rank writes the same; readers see a whole one


def read_manifest(folder: Path) -> dict[str, str | None]:
    """The run's manifest, {} when it has none or an unreadable one."""
    try:
        body = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(body, dict):
        return {}
    return {k: v for k, v in body.items() if isinstance(v, str) or v is None}


# -- liveness -------------------------------------------------------------------------------
def pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]"), "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def lock_path(page: Path) -> Path:
    """The lock file its process holds while it lives, beside `page`."""
    page = Path(page)
    return page.with_name(page.name.removesuffix(progress.PAGE_SUFFIX) + LOCK_SUFFIX)


def hold_lock(path: Path, *, wait_s: float = _LOCK_WAIT_S) -> int | None:
    """The SDK side: take `path`'s exclusive lock and keep it (the returned fd) for the
    process's life; None when another live process holds it (or the file cannot be made).

    An agent's probe holds a shared lock for microseconds, so a busy lock is retried for
    `wait_s`. The fd is not inherited by exec'd children, and a forked child (a DataLoader
    worker) drops its copy, so only this process keeps the lock held."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        log.warning("cannot create the liveness lock %s: %s", path, exc)
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or (
                time.monotonic() >= deadline
            ):
                os.close(fd)
                log.warning("cannot take the liveness lock %s: %s", path, exc)
                return None
            time.sleep(0.005)
    global _fork_hook
    if not _fork_hook:
        os.register_at_fork(after_in_child=_drop_in_child)
        _fork_hook = True
    _held.add(fd)
    return fd


def drop_lock(fd: int) -> None:
    """Release a lock `hold_lock` took (the process's clean end)."""
    _held.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


# The fds `hold_lock` holds: a forked child closes its copies (the parent's keep the locks).
_held: set[int] = set()
_fork_hook = False


def _drop_in_child() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


def lock_held(path: Path) -> bool | None:
    """The agent side: True while a live process holds `path`'s lock, False once none does,
    None when there is no lock file. Never blocks and never leaves a lock behind."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing the fd drops a lock taken here
    return False


def page_alive(
    page: Path,
    *,
    pid: int,
    pid_ns: str = "",
    alive: Callable[[int], bool] | None = None,
) -> bool:
    """Whether the process that wrote `page` still runs: its lock decides; without a lock
    file, `alive(pid)` (default `kill -0`), unless the page's PID namespace `pid_ns` is known
    and not ours (its pid names another process here, or none): then it counts as exited."""
    held = lock_held(lock_path(page))
    if held is not None:
        return held
    if pid_ns and pid_ns != _OWN_PID_NS:
        return False
    return (alive or pid_alive)(pid)


def local_pid(pid: int, pid_ns: str, *, proc_root: Path = Path("/proc")) -> int | None:
    """`pid` of namespace `pid_ns` as this process sees it, None when it cannot: the same pid
    in our own (or an unrecorded) namespace; else the process here that lives in `pid_ns` with
    that pid there (`NSpid` in /proc/N/status, visible from an ancestor namespace: an agent
    with the host's PIDs). Never a guess: a pid no process here matches is None."""
    if not pid_ns or pid_ns == _OWN_PID_NS:
        return pid if pid > 0 else None
    if pid <= 0:
        return None
    with contextlib.suppress(OSError):
        for entry in Path(proc_root).iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "ns" / "pid") != pid_ns:
                    continue
                status = (entry / "status").read_text()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == str(pid):
                    return int(entry.name)
    return None


# -- what is in use -------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


_OWN_PID_NS = pid_namespace()


def spool_locked(folder: Path) -> bool:
    """True while a process holds the spool's owner lock (its sender, or an agent replaying)."""
    try:
        fd = os.open(Path(folder) / spool.OWNER_FILE, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing the fd releases a lock taken here
    return False


def spool_holds_batches(folder: Path) -> bool:
    """True when the spool still holds batches to send or quarantined ones to look at."""
    folder = Path(folder)
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            if entry.suffix == ".vgl":
                return True
            if entry.name == spool.QUARANTINE_DIR and any(entry.iterdir()):
                return True
    return False


def _spool_in_use(folder: Path) -> bool:
    return spool_locked(folder) or spool_holds_batches(folder)


class _Page:
    """What clean-up needs of a page: its process and whether that process ended cleanly."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pid, self.pid_ns, self.finished, self.progress_wall_s = -1, "", False, 0.0
        try:
            reader = progress.PageReader(path)
        except (OSError, ValueError):
            return
        try:
            self.pid, self.pid_ns = reader.pid, reader.pid_ns
            snap = reader.snapshot()
            self.finished = snap.state is schema.RankState.FINISHED
            self.progress_wall_s = snap.progress_wall_s
        except (OSError, ValueError, TimeoutError):
            pass
        finally:
            reader.close()

    def alive(self, fallback: Callable[[int], bool]) -> bool:
        return page_alive(self.path, pid=self.pid, pid_ns=self.pid_ns, alive=fallback)


def _folders(parent: Path) -> list[Path]:
    """Sub-folders that are not spools (the agent's own spool sits in the root)."""
    with contextlib.suppress(OSError):
        return sorted(
            p for p in parent.iterdir() if p.is_dir() and not p.name.endswith(spool.SPOOL_SUFFIX)
        )
    return []


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # the job folder, once its last run is gone
        folder.parent.rmdir()


def remove_drained_spool(folder: Path) -> bool:
    """Remove a spool folder that holds nothing and that nobody holds; True when removed."""
    folder = Path(folder)
    if not folder.is_dir() or _spool_in_use(folder):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()


def release(
    folder: Path,
    *,
    own: Iterable[Path],
    alive: Callable[[int], bool] = pid_alive,
) -> bool:
    """A cleanly finished rank leaves: its `own` files go, and the folder goes when nothing in
    it is in use any more (no live process's page, no crashed rank's page, no spool holding
    batches or held by a process). True when the folder was removed."""
    folder = Path(folder)
    for path in own:
        if path.is_dir():
            remove_drained_spool(path)
        else:
            path.unlink(missing_ok=True)
    if not folder.is_dir() or _in_use(folder, alive=alive, keep_crashed=True):
        return False
    _remove(folder)
    log.debug("removed the progress folder %s", folder)
    return True


def _in_use(folder: Path, *, alive: Callable[[int], bool], keep_crashed: bool) -> bool:
    for entry in folder.iterdir():
        if entry.name.endswith(spool.SPOOL_SUFFIX) and entry.is_dir():
            if _spool_in_use(entry):
                return True
        elif entry.suffix == progress.PAGE_SUFFIX:
            page = _Page(entry)
            if page.alive(alive) or (keep_crashed and not page.finished and page.pid > 0):
                return True
        elif entry.suffix == LOCK_SUFFIX and lock_held(entry):  # a rank starting up
            return True
    return False


def last_activity(folder: Path) -> float:
    """Wall time of the folder's last sign of life: its entries' mtimes, its pages' progress."""
    newest = pagelayout.mtime(folder)
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            newest = max(newest, pagelayout.mtime(entry))
            if entry.suffix == progress.PAGE_SUFFIX:
                newest = max(newest, _Page(entry).progress_wall_s)
    return newest


def expire(
    root: Path,
    *,
    ttl_s: float,
    now_s: float,
    alive: Callable[[int], bool] = pid_alive,
    job: str | None = None,
) -> list[Path]:
    """The node agent's sweep: remove every run folder under `root` (of `job` alone when given:
    a launcher tidying after its job) whose processes are all gone, whose spools are drained
    (replayed) and released, and whose last activity is at least `ttl_s` old; the removed
    folders."""
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    jobs = _folders(root) if job is None else [p for p in _folders(root) if p.name == job]
    for job_dir in jobs:
        for folder in _folders(job_dir):
            try:
                if _in_use(folder, alive=alive, keep_crashed=False):
                    continue
                if now_s - last_activity(folder) < ttl_s:
                    continue
            except OSError:  # removed meanwhile
                continue
            _remove(folder)
            removed.append(folder)
            log.info("expired the progress folder %s (its processes are gone)", folder)
        with contextlib.suppress(OSError):
            if not any(job_dir.iterdir()) and now_s - pagelayout.mtime(job_dir) >= ttl_s:
                job_dir.rmdir()
    return removed
