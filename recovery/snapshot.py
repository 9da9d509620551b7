"""In-memory snapshots of every step's training state, kept outside the process that may fail:
the files, their layout and the peer exchange (the low-level layer).

Gemini-style: a rank serialises its state into node shared memory (/dev/shm, which outlives the
process) and sends a copy to its peer rank on the next node, which keeps it in *its* node's shared
memory — so losing a whole node loses nothing. `Snapshotter.save` does all of it on the calling
thread (all ranks must call it at the same step); `vigil.recovery.snapshot_async` does the same
work in the background for training loops, and `vigil.recovery.snapshots` is the public API over
both. Files are written to a temporary name and renamed, so a reader sees a whole snapshot or none.
This module holds no threads and creates no process groups.

Layout: <root>/<job>/<node>/rank-<r>/step-<s>.pt (primary) and
<root>/<job>/<node>/replica-of-rank-<r>/step-<s>.pt (a peer's copy).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vigil.env import EnvVar
from vigil.recovery import snapshot_files

log = logging.getLogger(__name__)

DEFAULT_ROOT = snapshot_files.DEFAULT_ROOT
_STEP = snapshot_files.STEP_FILE


@dataclass(frozen=True)
class Snapshot:
    step: int
    path: Path
    replica: bool


@dataclass(kw_only=True)
class Snapshotter:
    job: str
    node: str
    rank: int
    world_size: int
    ranks_per_node: int
    root: Path = DEFAULT_ROOT
    # Two per rank: the newest, and the one before it in case the newest is being written.
    keep: int = 2
    # The process group the peer exchange runs over (None: the default group). The background
    # writer passes a gloo group of its own, so replication never queues behind training.
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError("ranks_per_node must divide the world size")
        if self.keep < 1:
            raise ValueError("keep must be >= 1")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def peer_to(self) -> int:
        """The rank on the next node that holds this rank's replica."""
        return (self.rank + self.ranks_per_node) % self.world_size

    @property
    def peer_from(self) -> int:
        return (self.rank - self.ranks_per_node) % self.world_size

    @property
    def node_dir(self) -> Path:
        return self.root / self.job / self.node

    def primary_dir(self, rank: int | None = None) -> Path:
        return self.node_dir / f"rank-{self.rank if rank is None else rank}"

    @property
    def replica_dir(self) -> Path:
        """Where this node keeps the copy of `peer_from`'s snapshots."""
        return self.node_dir / f"replica-of-rank-{self.peer_from}"

    @property
    def replicates(self) -> bool:
        return self.num_nodes > 1 and dist.is_available() and dist.is_initialized()

    def save(self, step: int, state: Mapping[str, Any]) -> int:
        """Snapshot `state` for `step` locally and on the peer node; returns bytes written."""
        path = self.write_primary(step, state)
        if self.replicates:
            self.replicate(step, path)
        return path.stat().st_size

    def write_primary(self, step: int, state: Mapping[str, Any]) -> Path:
        """Serialise `state` into this rank's folder (temp file, then an atomic rename)."""
        folder = self.primary_dir()
        tmp = _recycled(folder, step, self.keep)
        with open(tmp, "r+b") as fh:  # over the old pages: no fresh shared memory to fault in
            torch.save(dict(state), fh)
            fh.truncate()
        return _commit(folder, tmp, step, self.keep)

    def replicate(self, step: int, path: Path | None) -> int:
        """Send this rank's snapshot file (None: nothing to send this time) to `peer_to` and
        keep what `peer_from` sends; every rank of the job calls it for the same snapshot.

        Returns the step of the replica received (-1 when the peer had nothing to send).
        """
        size = path.stat().st_size if path is not None else 0
        header_out = torch.tensor([step if path is not None else -1, size], dtype=torch.int64)
        header_in = torch.zeros(2, dtype=torch.int64)
        _send_recv(header_out, self.peer_to, header_in, self.peer_from, self.group)
        got_step, got_size = (int(v) for v in header_in.tolist())
        folder = self.replica_dir
        tmp = _recycled(folder, got_step, self.keep)
        # Both sides map files: the sender reads its snapshot's pages, the receiver writes
        # straight into the new file's (no copy through Python bytes).
        out = _mapped(path, size) if path is not None and size else None
        into = _mapped(tmp, got_size, create=True) if got_step >= 0 and got_size else None
        works = []
        if out is not None:
            works.append(send(out, self.peer_to, self.group))
        if into is not None:
            works.append(recv(into, self.peer_from, self.group))
        for work in works:
            if work is not None:
                work.wait()
        if into is None:
            return -1
        del into
        _commit(folder, tmp, got_step, self.keep)
        return got_step

    def newest(self) -> Snapshot | None:
        """This rank's newest snapshot on any node still present (primary or a peer's replica)."""
        found: list[Snapshot] = []
        job_dir = self.root / self.job
        if not job_dir.exists():
            return None
        for node_dir in job_dir.iterdir():
            for name, replica in (
                (f"rank-{self.rank}", False),
                (f"replica-of-rank-{self.rank}", True),
            ):
                folder = node_dir / name
                if folder.is_dir():
                    found += [
                        Snapshot(int(m.group(1)), p, replica)
                        for p in folder.iterdir()
                        if (m := _STEP.match(p.name))
                    ]
        return max(found, key=lambda s: (s.step, not s.replica), default=None)

    def load(self, snapshot: Snapshot) -> dict[str, Any]:
        state: dict[str, Any] = torch.load(snapshot.path, map_location="cpu", weights_only=False)
        return state


def from_env(
    *, job: str | None = None, root: str | os.PathLike[str] | None = None, keep: int = 2
) -> Snapshotter | None:
    """A Snapshotter for this rank: under `root`, else $VIGIL_SNAPSHOT_DIR (`vigil run` sets it
    for every rank, with VIGIL_JOB and VIGIL_NODE); None when neither is set."""
    root = root if root is not None else os.environ.get(EnvVar.SNAPSHOT_DIR)
    if not root:
        return None
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    return Snapshotter(
        job=job or os.environ.get(EnvVar.JOB) or "vigil-job",
        node=os.environ.get(EnvVar.NODE) or socket.gethostname(),
        rank=dist.get_rank() if distributed else 0,
        world_size=world,
        ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        root=Path(root),
        keep=keep,
    )


def _send_recv(out: torch.Tensor, to: int, into: torch.Tensor, source: int, group: Any) -> None:
    works = [send(out, to, group), recv(into, source, group)]
    for work in works:
        if work is not None:
            work.wait()


# Snapshots' own traffic goes straight to their process group object, below the functions the
# SDK records, so it never shows in the job's collective metrics or hang evidence. The default
# group (group None: the synchronous `save` of simple jobs) goes through torch.distributed.
def send(tensor: torch.Tensor, to: int, group: Any) -> Any:
    """Start sending `tensor` to global rank `to`; the work to wait on."""
    if group is None:
        return dist.isend(tensor, to)
    return group.send([tensor], dist.get_group_rank(group, to), 0)


def recv(tensor: torch.Tensor, source: int, group: Any) -> Any:
    if group is None:
        return dist.irecv(tensor, source)
    return group.recv([tensor], dist.get_group_rank(group, source), 0)


def all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    if group is None:
        dist.all_reduce(tensor, op=op)
    else:
        group.allreduce([tensor], op).wait()


def _recycled(folder: Path, step: int, keep: int) -> Path:
    """The temp file for `step`'s snapshot: the oldest snapshot renamed, when committing this
    one would delete it anyway (its shared-memory pages are reused), else a new empty file.
    The newest `keep - 1` snapshots stay whole meanwhile; ranks are at most one snapshot apart,
    so they still share a step."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".step-{step}.tmp"
    # A temp file left by a write that was cut short (only this rank writes this folder).
    stale = [p for p in folder.iterdir() if p.name.endswith(".tmp") and p != tmp]
    steps = sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP.match(p.name)))
    if stale:
        os.replace(stale.pop(), tmp)
        for extra in stale:
            extra.unlink(missing_ok=True)
    elif len(steps) >= keep and steps[0] < step:
        os.replace(folder / f"step-{steps[0]}.pt", tmp)
    else:
        tmp.touch()
    return tmp


def _mapped(path: Path, size: int, *, create: bool = False) -> torch.Tensor:
    """A uint8 tensor over the file's bytes (resized to `size` bytes when `create`)."""
    if create:
        os.truncate(path, size)  # keeps the pages a recycled file already has
    return torch.from_file(str(path), shared=create, size=size, dtype=torch.uint8)


def _commit(folder: Path, tmp: Path, step: int, keep: int) -> Path:
    final = folder / f"step-{step}.pt"
    os.replace(tmp, final)  # readers see a whole snapshot or none
    steps = sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP.match(p.name)))
    for old in steps[:-keep]:
        (folder / f"step-{old}.pt").unlink(missing_ok=True)
    return final


def local_copy(tree: Any) -> Any:
    """A CPU copy of a (nested) state dict holding only this rank's pieces.

    DTensors (FSDP2 shards, tensor-parallel slices) become their local tensors, so a snapshot is
    restorable only into the same layout — which restarts and migrations keep.
    """
    if isinstance(tree, DTensor):
        return tree.to_local().detach().to("cpu", copy=True)
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: local_copy(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(local_copy(value) for value in tree)
    return tree


def restore_local(tree: Any, saved: Any, path: str = "") -> Any:
    """Copy `saved` (from `local_copy`) into `tree` in place; non-tensor leaves are replaced.

    Raises ValueError naming the first key whose structure or shape differs (another layout).
    """
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(
                f"snapshot {path or '<root>'}: {got} does not fit {tuple(local.shape)}"
            )
        with torch.no_grad():
            local.copy_(saved)
        return tree
    if isinstance(tree, dict):
        if not isinstance(saved, dict) or saved.keys() != tree.keys():
            raise ValueError(f"snapshot {path or '<root>'}: keys differ from the live state")
        return {
            k: restore_local(v, saved[k], f"{path}.{k}" if path else str(k))
            for k, v in tree.items()
        }
    if isinstance(tree, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(tree):
            raise ValueError(f"snapshot {path or '<root>'}: lengths differ from the live state")
        return type(tree)(
            restore_local(v, s, f"{path}[{i}]")
            for i, (v, s) in enumerate(zip(tree, saved, strict=True))
        )
    return saved
