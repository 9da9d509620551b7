"""In-memory snapshots of every step's training state, kept outside the process that may fail.

Gemini-style: after each step a rank serialises its state into node shared memory (/dev/shm, which
outlives the process) and sends a copy to its peer rank on the next node, which keeps it in *its*
node's shared memory — so losing a whole node loses nothing. On restart a rank restores the newest
snapshot it can find (its own node's, else the replica a peer holds) when it is newer than the last
persistent checkpoint. The exchange uses torch.distributed point-to-point ops, so it works over gloo
and NCCL alike; all ranks must call `save` at the same step.

Layout: <root>/<job>/<node>/rank-<r>/step-<s>.pt (primary) and
<root>/<job>/<node>/replica-of-rank-<r>/step-<s>.pt (a peer's copy).
"""

from __future__ import annotations

import io
import logging
import os
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

    def primary_dir(self, rank: int | None = None) -> Path:
        return self.root / self.job / self.node / f"rank-{self.rank if rank is None else rank}"

    def save(self, step: int, state: Mapping[str, Any]) -> int:
        """Snapshot `state` for `step` locally and on the peer node; returns bytes written."""
        buffer = io.BytesIO()
        torch.save(dict(state), buffer)
        payload = buffer.getvalue()
        _write(self.primary_dir(), step, payload, self.keep)
        if self.num_nodes > 1 and dist.is_available() and dist.is_initialized():
            received = self._exchange(payload)
            replica_dir = self.root / self.job / self.node / f"replica-of-rank-{self.peer_from}"
            _write(replica_dir, step, received, self.keep)
        return len(payload)

    def _exchange(self, payload: bytes) -> bytes:
        size_out = torch.tensor([len(payload)], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        _send_recv(size_out, self.peer_to, size_in, self.peer_from)
        data_out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        received = bytearray(int(size_in.item()))
        # irecv writes straight into `received` through a tensor view of it.
        data_in = torch.frombuffer(received, dtype=torch.uint8)
        _send_recv(data_out, self.peer_to, data_in, self.peer_from)
        return bytes(received)

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


def from_env(*, job: str) -> Snapshotter | None:
    """A Snapshotter for a rank started by `vigil run` (VIGIL_SNAPSHOT_DIR set), else None."""
    root = os.environ.get(EnvVar.SNAPSHOT_DIR)
    if not root or not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return Snapshotter(
        job=job,
        node=os.environ.get(EnvVar.NODE, "localhost"),
        rank=dist.get_rank(),
        world_size=world,
        ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        root=Path(root),
    )


def _send_recv(out: torch.Tensor, to: int, into: torch.Tensor, source: int) -> None:
    # Plain isend/irecv (not batch_isend_irecv): profiling wrappers around them stay valid.
    works = [dist.isend(out, to), dist.irecv(into, source)]
    for work in works:
        if work is not None:
            work.wait()


def _write(folder: Path, step: int, payload: bytes, keep: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".step-{step}.tmp"
    tmp.write_bytes(payload)
    os.replace(tmp, folder / f"step-{step}.pt")  # readers see a whole snapshot or none
    steps = sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP.match(p.name)))
    for old in steps[:-keep]:
        (folder / f"step-{old}.pt").unlink(missing_ok=True)


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
