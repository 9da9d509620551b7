"""Checkpoints with torch.distributed.checkpoint (DCP): async save, checksum manifest, an atomic
commit marker written last, keep-last-K, and resharding load.

Layout: `<root>/step-00000010/` holds DCP's files, then `manifest.json` (step, sizes and SHA-256
of every file), then the empty `COMMITTED` marker, each written to a temporary name, fsynced and
renamed. A directory without the marker is a save that never finished and is never resumed from;
`latest_committed` also re-checks the manifest. Rank 0 commits once DCP's save has finished on
every rank (DCP's final gather happens on rank 0). The background save runs on its own gloo group
so it never interleaves with the training collectives. This module must not touch the model
beyond reading and loading state dicts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

from vigil.trainer import recipes

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
_PREFIX = "step-"
_HASH_CHUNK = 1 << 20


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX) or not name[len(_PREFIX) :].isdigit():
        return None
    return int(name[len(_PREFIX) :])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def commit(path: Path, *, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the checksum manifest, then the commit marker: from then on `path` is resumable."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(path.iterdir())
        if p.is_file() and p.name not in (MANIFEST, COMMIT_MARKER) and not p.name.endswith(".tmp")
    }
    manifest = {"step": step, "files": files, "committed_s": time.time(), **(extra or {})}
    _write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    _write_atomic(path / COMMIT_MARKER, b"")
    return manifest


def verify(path: Path) -> bool:
    """True when `path` is committed and every file matches its manifest entry."""
    if not (path / COMMIT_MARKER).is_file():
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("checkpoint %s has an unreadable manifest: %s", path, exc)
        return False
    for name, entry in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            log.warning("checkpoint %s: %s is missing or has the wrong size", path, name)
            return False
        if _sha256(file) != entry["sha256"]:
            log.warning("checkpoint %s: %s fails its checksum", path, name)
            return False
    return True


def committed_steps(root: Path) -> list[int]:
    """Steps with a commit marker, oldest first (manifests not re-checked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [_step_of(p) for p in root.iterdir() if (p / COMMIT_MARKER).is_file()]
    return sorted(s for s in steps if s is not None)


def latest_committed(root: Path) -> Path | None:
    """The newest committed checkpoint whose files match their manifest, else None."""
    for step in reversed(committed_steps(root)):
        path = step_dir(root, step)
        if verify(path):
            return path
        log.warning("skipping checkpoint %s: it does not verify", path)
    return None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last`, and stale partial saves."""
    committed = committed_steps(root)
    doomed = [step_dir(root, s) for s in committed[:-keep_last]]
    newest = committed[-1] if committed else -1
    for path in Path(root).iterdir():
        step = _step_of(path)
        # A partial save older than the newest commit can never finish any more.
        if step is not None and step < newest and not (path / COMMIT_MARKER).exists():
            doomed.append(path)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


@dataclasses.dataclass(kw_only=True)
class SaveResult:
    step: int
    path: Path
    blocked_s: float  # how long training was held up (staging)
    save_s: float = 0.0  # from start to commit
    bytes: int = 0


class Checkpointer:
    """Saves and loads one job's checkpoints; one save in flight at a time."""

    def __init__(
        self,
        config: recipes.CheckpointConfig,
        *,
        rank: int,
        group: dist.ProcessGroup | None,
        extra: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait_timeout_s: float = 600.0,
        on_commit: Callable[[SaveResult], None] | None = None,
    ) -> None:
        if config.directory is None:
            raise ValueError("Checkpointer needs checkpoint.directory")
        self.config = config
        self.root = Path(config.directory)
        self.rank = rank
        self.group = group
        self.extra = extra or {}
        self._clock = clock
        self._wait_timeout_s = wait_timeout_s
        # Told of each committed save on rank 0 (the trainer reports it through the SDK).
        self._on_commit = on_commit
        self._pending: concurrent.futures.Future[None] | None = None
        self._done: list[SaveResult] = []
        self._lock = threading.Lock()
        self.last_saved_step = -1

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def save(self, step: int, state: dict[str, Any], *, block: bool = False) -> SaveResult:
        """Start saving `state` as step `step`; returns once training may continue."""
        self.wait()
        path = step_dir(self.root, step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():  # a partial save of this step from an earlier attempt
                shutil.rmtree(path)
        self._barrier()
        start = self._clock()
        result = SaveResult(step=step, path=path, blocked_s=0.0)
        if block or not self.config.async_save:
            state_dict_saver.save(state, checkpoint_id=path, process_group=self.group)
            result.blocked_s = self._clock() - start
            self._finish(result, start)
        else:
            committed: concurrent.futures.Future[None] = concurrent.futures.Future()
            future = state_dict_saver.async_save(
                state, checkpoint_id=path, process_group=self.group
            )
            assert isinstance(future, concurrent.futures.Future)  # no async_stager given
            result.blocked_s = self._clock() - start
            future.add_done_callback(lambda fut: self._on_saved(fut, result, start, committed))
            self._pending = committed
        self.last_saved_step = step
        log.info("checkpoint step %d: save started (blocked %.3fs)", step, result.blocked_s)
        return result

    def _on_saved(
        self,
        future: concurrent.futures.Future[Any],
        result: SaveResult,
        start: float,
        committed: concurrent.futures.Future[None],
    ) -> None:
        """Runs in DCP's writer thread once this rank's part (rank 0: all parts) is written."""
        try:
            future.result()
            self._finish(result, start)
        except Exception as exc:  # surfaced to the training thread by wait()
            log.error("checkpoint step %d failed: %s", result.step, exc)
            committed.set_exception(exc)
        else:
            committed.set_result(None)

    def _finish(self, result: SaveResult, start: float) -> None:
        if self.rank != 0:
            return
        manifest = commit(result.path, step=result.step, extra=self.extra)
        result.save_s = self._clock() - start
        result.bytes = sum(int(f["bytes"]) for f in manifest["files"].values())
        removed = prune(self.root, self.config.keep_last)
        log.info(
            "checkpoint step %d: committed (%d bytes, %.3fs, pruned %d)",
            result.step,
            result.bytes,
            result.save_s,
            len(removed),
        )
        with self._lock:
            self._done.append(result)
        if self._on_commit is not None:
            try:
                self._on_commit(result)
            except Exception as exc:  # a report of the commit never fails the save
                log.warning("checkpoint step %d: commit report failed: %s", result.step, exc)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the save in flight (if any) has finished and been committed."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result(timeout=timeout_s if timeout_s is not None else self._wait_timeout_s)

    def take_finished(self) -> list[SaveResult]:
        """Saves committed since the last call (rank 0 only; others get none)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def resume_path(self) -> Path | None:
        """The checkpoint every rank will load: chosen (and verified) by rank 0, then shared."""
        choice: list[str | None] = [None]
        if self.rank == 0:
            found = latest_committed(self.root)
            choice[0] = str(found) if found is not None else None
        if self.distributed:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        return Path(choice[0]) if choice[0] is not None else None

    def load(self, path: Path, state: dict[str, Any]) -> int:
        """Load `path` into `state` in place (resharding as needed); returns its step."""
        state_dict_loader.load(state, checkpoint_id=path, process_group=self.group)
        manifest = json.loads((path / MANIFEST).read_text())
        return int(manifest["step"])
