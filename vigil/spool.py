"""The on-disk queue of batches waiting for the collector: a file per batch, an owner, a quarantine.

A spool folder holds:

    <seq:016d>-<records>-<batch id>.vgl   one codec frame each; names sort in send order
    owner                                 the owning process's pid and start time, flock'd by it
    quarantine/                           batches the collector kept refusing (the newest few)

A batch id that is not a plain file name (`[0-9A-Za-z_.-]`, at most 128 characters: a
controller's ids hold `/`) is named by its hash, `~<blake2b>`, and read back from the frame at
open.

The index (names, sizes, the byte total) is built once at open and kept in memory, so `push` is
O(1) and the byte bound drops the oldest batches from a deque. The index sees only this object's
own changes: open a spool once per process.

The owner holds an exclusive `flock` on `owner` for as long as the spool is open; the kernel
releases it when the process dies, however it dies. `Spool.claim` (a node agent, a later run of
the same sender) takes a spool only when it gets that lock and the recorded owner is gone, so a
live owner's spool is never replayed and two processes never replay the same spool at once.
`open_spool` falls back to a sibling folder while the spool is held; `siblings` lists them all.

File handling only: no network, no threads of its own; a lock makes it safe to use from the
flusher and from the thread shutting it down. Imports no subsystem.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
from pathlib import Path

from vigil import codec

log = logging.getLogger(__name__)

OWNER_FILE = "owner"
QUARANTINE_DIR = "quarantine"
SPOOL_SUFFIX = ".spool"
_BATCH_SUFFIX = ".vgl"
PROC_ROOT = Path("/proc")
# Quarantined batches are kept for a person to look at, not replayed: 100 is plenty to see what
# the collector refuses, and bounds the disk a collector refusing everything can cost.
DEFAULT_MAX_QUARANTINED = 100
_PLAIN_ID = re.compile(r"[0-9A-Za-z_.-]{1,128}")
_HASHED = "~"


def diag_dir(data_dir: Path) -> Path:
    """Where `vigil diag` spools its results under a data dir; the node agent replays it too."""
    return Path(data_dir) / "spool" / "diag"


class SpoolBusyError(RuntimeError):
    """Another live process (or an agent replaying it) holds the spool's owner lock."""


@dataclasses.dataclass(frozen=True)
class SpooledBatch:
    path: Path
    batch_id: str
    num_records: int
    size_bytes: int
    seq: int  # send order


@dataclasses.dataclass(frozen=True)
class Owner:
    pid: int
    start: str  # the process's start time in clock ticks (/proc/<pid>/stat), "" when unknown


def process_start(pid: int, proc_root: Path = PROC_ROOT) -> str:
    """When `pid` started, from /proc/<pid>/stat (field 22), or "" where it cannot be read."""
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return ""
    fields = text.rsplit(")", 1)[-1].split()  # the command name may hold spaces and ')'
    return fields[19] if len(fields) > 19 else ""


def owner_alive(owner: Owner, proc_root: Path = PROC_ROOT) -> bool:
    """True while the owner's process runs (a reused pid with another start time is not it)."""
    if owner.pid <= 0:
        return False
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    now = process_start(owner.pid, proc_root)
    return not (owner.start and now and now != owner.start)


def siblings(directory: Path) -> list[Path]:
    """`directory` and the folders `open_spool` falls back to beside it (`<name>.<pid>-<n>`),
    those that exist."""
    directory = Path(directory)
    pattern = f"{directory.stem}.*-*{directory.suffix}"
    found = [directory] if directory.is_dir() else []
    if directory.parent.is_dir():
        found += sorted(p for p in directory.parent.glob(pattern) if p.is_dir())
    return found


def _lock_owner(path: Path, *, create: bool) -> int | None:
    """An fd of `path` holding its exclusive flock, or None when someone else holds it."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _read_owner(fd: int) -> Owner | None:
    text = os.pread(fd, 256, 0).decode("ascii", "replace").split()
    if not text or not text[0].isdigit():
        return None
    return Owner(int(text[0]), text[1] if len(text) > 1 else "")


def _parse(path: Path) -> tuple[int, int, str] | None:
    seq, _, rest = path.stem.partition("-")
    count, _, batch_id = rest.partition("-")
    if not (seq.isdigit() and count.isdigit() and batch_id):
        return None
    if batch_id.startswith(_HASHED):
        batch_id = _framed_id(path) or batch_id
    return int(seq), int(count), batch_id


def _framed_id(path: Path) -> str | None:
    """The batch id inside a spooled frame (for names that carry only its hash)."""
    try:
        return codec.decode_batch(path.read_bytes()).batch_id
    except (OSError, codec.DecodeError):
        return None  # sent under its hash, the collector refuses it and it is quarantined


class Spool:
    """Batches waiting for the collector, oldest first, owned by this process while open."""

    previous_owner: Owner | None = None  # set by `claim`: whose spool this was

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        max_quarantined: int = DEFAULT_MAX_QUARANTINED,
        _owner_fd: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        fd = _owner_fd if _owner_fd is not None else self._take(self.directory)
        self._fd: int | None = fd
        self.max_bytes = max_bytes
        self.max_quarantined = max_quarantined
        self.dropped_batches = 0
        self.dropped_records = 0
        self.quarantined_batches = 0
        self._lock = threading.Lock()
        me = os.getpid()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{me} {process_start(me)}\n".encode(), 0)
        self._batches: collections.deque[SpooledBatch] = collections.deque()
        self._bytes = 0
        self._next = 0
        self._quarantine: collections.deque[Path] = collections.deque()
        self._index()

    @staticmethod
    def _take(directory: Path) -> int:
        for _ in range(3):  # an agent may remove an empty folder between mkdir and open
            directory.mkdir(parents=True, exist_ok=True)
            try:
                fd = _lock_owner(directory / OWNER_FILE, create=True)
            except FileNotFoundError:
                continue
            if fd is None:
                raise SpoolBusyError(f"spool {directory} is in use by another process")
            return fd
        raise SpoolBusyError(f"spool {directory} kept disappearing while opened")

    @classmethod
    def claim(
        cls,
        directory: Path,
        *,
        max_bytes: int,
        max_quarantined: int = DEFAULT_MAX_QUARANTINED,
        proc_root: Path = PROC_ROOT,
    ) -> Spool | None:
        """Take over the spool of an owner that is gone; None while it lives or is claimed."""
        fd = _lock_owner(Path(directory) / OWNER_FILE, create=False)
        if fd is None:
            return None
        owner = _read_owner(fd)
        if owner is None or owner_alive(owner, proc_root):
            os.close(fd)
            return None
        spool = cls(directory, max_bytes=max_bytes, max_quarantined=max_quarantined, _owner_fd=fd)
        spool.previous_owner = owner
        return spool

    def _index(self) -> None:
        found, loose = [], []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a push cut short by a crash
            elif path.suffix == _BATCH_SUFFIX:
                parsed = _parse(path)
                if parsed is None:
                    loose.append(path)
                else:
                    found.append((parsed, path))
        for (seq, count, batch_id), path in sorted(found):
            self._insert(SpooledBatch(path, batch_id, count, path.stat().st_size, seq))
            self._next = seq + 1
        for path in sorted(loose, key=lambda p: p.stat().st_mtime):
            self._adopt(path)

    def _adopt(self, path: Path) -> None:
        """Take in a frame file named otherwise (`<batch id>.vgl`, as `vigil diag` spooled
        before this spool): renamed into send order after the others."""
        try:
            frame = path.read_bytes()
            batch = codec.decode_batch(frame)
        except (OSError, codec.DecodeError) as exc:
            log.warning(
                "spool %s: leaving %s alone, not a batch frame (%s)", self.directory, path, exc
            )
            return
        seq = self._take_seq()
        target = self.directory / _name(seq, batch.batch_id, len(batch.records))
        os.replace(path, target)
        self._insert(SpooledBatch(target, batch.batch_id, len(batch.records), len(frame), seq))
        quarantine = self.directory / QUARANTINE_DIR
        if quarantine.is_dir():
            self._quarantine.extend(sorted(quarantine.glob(f"*{_BATCH_SUFFIX}")))

    def _insert(self, batch: SpooledBatch) -> None:
        """Into send order: at the end, or a few places before it (a reserved place)."""
        batches = self._batches
        at = len(batches)
        while at and batches[at - 1].seq > batch.seq:
            at -= 1
        batches.insert(at, batch)
        self._bytes += batch.size_bytes

    def _take_seq(self) -> int:
        seq, self._next = self._next, self._next + 1
        return seq

    def reserve(self, count: int) -> int:
        """Places in send order for `count` batches pushed later (`push(seq=...)`): a round
        still sending them keeps them ahead of what another thread spools meanwhile."""
        with self._lock:
            first, self._next = self._next, self._next + count
            return first

    def push(
        self, batch_id: str, num_records: int, frame: bytes, *, seq: int | None = None
    ) -> list[SpooledBatch]:
        """Add a batch after the others (or at its reserved place); returns the oldest ones
        the byte bound dropped."""
        with self._lock:
            seq = self._take_seq() if seq is None else seq
            path = self.directory / _name(seq, batch_id, num_records)
            _write(path, frame)
            self._insert(SpooledBatch(path, batch_id, num_records, len(frame), seq))
            return self._enforce_bound()

    def _enforce_bound(self) -> list[SpooledBatch]:
        dropped = []
        while self._bytes > self.max_bytes and self._batches:
            batch = self._batches.popleft()
            self._bytes -= batch.size_bytes
            batch.path.unlink(missing_ok=True)
            self.dropped_batches += 1
            self.dropped_records += batch.num_records
            dropped.append(batch)
            log.warning(
                "spool over %d bytes: dropped batch %s (%d records)",
                self.max_bytes,
                batch.batch_id,
                batch.num_records,
            )
        return dropped

    def pending(self) -> list[SpooledBatch]:
        """The spooled batches, oldest first (a copy of the index)."""
        with self._lock:
            return list(self._batches)

    def remove(self, batch: SpooledBatch) -> None:
        """Forget a delivered batch and delete its file."""
        with self._lock:
            if self._forget(batch):
                batch.path.unlink(missing_ok=True)

    def _forget(self, batch: SpooledBatch) -> bool:
        try:
            self._batches.remove(batch)  # usually the head
        except ValueError:  # dropped by the bound meanwhile
            return False
        self._bytes -= batch.size_bytes
        return True

    def quarantine(self, batch: SpooledBatch) -> None:
        """Move a spooled batch the collector keeps refusing into `quarantine/`."""
        with self._lock:
            if self._forget(batch):
                target = self._quarantine_dir() / batch.path.name
                try:
                    os.replace(batch.path, target)
                except FileNotFoundError:
                    return
                self._kept(target)

    def quarantine_frame(self, batch_id: str, num_records: int, frame: bytes) -> None:
        """Keep a batch that was never spooled in `quarantine/`."""
        with self._lock:
            target = self._quarantine_dir() / _name(self._take_seq(), batch_id, num_records)
            _write(target, frame)
            self._kept(target)

    def _quarantine_dir(self) -> Path:
        path = self.directory / QUARANTINE_DIR
        path.mkdir(exist_ok=True)
        return path

    def _kept(self, path: Path) -> None:
        self.quarantined_batches += 1
        self._quarantine.append(path)
        while len(self._quarantine) > self.max_quarantined:
            self._quarantine.popleft().unlink(missing_ok=True)

    def quarantined(self) -> list[Path]:
        """The quarantined batch files kept, oldest first."""
        with self._lock:
            return list(self._quarantine)

    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._batches)

    def close(self) -> None:
        """Release the owner lock (idempotent); the files stay."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def close_and_remove_if_empty(self) -> bool:
        """Delete the folder when nothing is pending or quarantined (a replayed orphan)."""
        with self._lock:
            empty = not self._batches and not self._quarantine
            if empty:
                (self.directory / OWNER_FILE).unlink(missing_ok=True)
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        if empty:
            try:
                if (self.directory / QUARANTINE_DIR).is_dir():
                    (self.directory / QUARANTINE_DIR).rmdir()
                self.directory.rmdir()
            except OSError:  # gone already, or a new owner started writing to it
                pass
        return empty


def _name(seq: int, batch_id: str, num_records: int) -> str:
    if not _PLAIN_ID.fullmatch(batch_id):
        batch_id = _HASHED + hashlib.blake2b(batch_id.encode(), digest_size=16).hexdigest()
    return f"{seq:016d}-{num_records}-{batch_id}{_BATCH_SUFFIX}"


def _write(path: Path, frame: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(frame)
    os.replace(tmp, path)


def open_spool(
    directory: Path, *, max_bytes: int, max_quarantined: int = DEFAULT_MAX_QUARANTINED
) -> Spool:
    """Open `directory` as this process's spool; while another holds it (an agent replaying
    what an earlier process left there), a sibling folder `<name>.<pid>-<n>.spool` instead."""
    directory = Path(directory)
    try:
        return Spool(directory, max_bytes=max_bytes, max_quarantined=max_quarantined)
    except SpoolBusyError:
        pass
    for n in range(1, 100):
        sibling = directory.with_name(f"{directory.stem}.{os.getpid()}-{n}{directory.suffix}")
        try:
            spool = Spool(sibling, max_bytes=max_bytes, max_quarantined=max_quarantined)
        except SpoolBusyError:
            continue
        log.info("spool %s is in use; spooling to %s", directory, sibling)
        return spool
    raise SpoolBusyError(f"no free spool folder beside {directory}")
