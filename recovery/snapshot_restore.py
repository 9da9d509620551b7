"""Restoring the newest snapshot every rank can get: its own node's, else a peer node's replica.

Each rank lists the snapshot files in its own node's shared memory only (its own, its node
mates', the replicas it keeps for the previous node), the ranks share those lists (one
all_gather_object over a gloo group, the one collective of snapshots the SDK sees, once at
start), and all of them pick the same step: the newest that every
rank's state is held at somewhere and that is newer than the checkpoint (`plans`, pure). A rank
whose files are gone (its node's memory was lost) receives its snapshot from the rank that holds
the replica, over the same group. Only files renamed into place are listed, so a restore never
reads a partial snapshot; when one fails to load or apply anywhere, every rank falls back to the
next older step together. Must not write snapshot files.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vigil.recovery import snapshot, snapshot_files

log = logging.getLogger(__name__)

_FOLDER = re.compile(r"^(?:rank|replica-of-rank)-(\d+)$")
TRIES = 2  # steps tried before giving up on snapshots (the newest, and the one before it)


@dataclasses.dataclass(frozen=True)
class Plan:
    step: int
    sources: dict[int, int]  # rank -> the rank whose node holds that rank's file (itself: local)


def node_holdings(files: snapshot.Snapshotter) -> dict[tuple[int, int], Path]:
    """{(owner rank, step): file} of every complete snapshot in this node's shared memory."""
    held: dict[tuple[int, int], Path] = {}
    if not files.node_dir.is_dir():
        return held
    for folder in sorted(files.node_dir.iterdir()):
        owner = _FOLDER.match(folder.name)
        if owner is None or not folder.is_dir():
            continue
        for path in folder.iterdir():
            if step := snapshot_files.STEP_FILE.match(path.name):
                held.setdefault((int(owner.group(1)), int(step.group(1))), path)
    return held


def plans(
    holdings: Sequence[Sequence[tuple[int, int]]], world_size: int, newer_than: int
) -> list[Plan]:
    """Candidate steps, newest first: every rank's file is held by some rank (`holdings[r]`
    lists what rank r's node holds), preferring each rank's own node."""
    holders: dict[tuple[int, int], list[int]] = {}
    for reporter, held in enumerate(holdings):
        for owner, step in held:
            holders.setdefault((owner, step), []).append(reporter)
    steps = {step for _, step in holders}
    found = []
    for step in sorted(steps, reverse=True):
        if step <= newer_than:
            break
        if all((rank, step) in holders for rank in range(world_size)):
            sources = {
                rank: rank if rank in holders[(rank, step)] else min(holders[(rank, step)])
                for rank in range(world_size)
            }
            found.append(Plan(step, sources))
    return found


def restore(
    files: snapshot.Snapshotter,
    apply: Callable[[Any], None],
    *,
    newer_than: int = -1,
    group: Any = None,
) -> tuple[int, str] | None:
    """Load and `apply` the newest snapshot all ranks agree on: its step and where this rank's
    copy came from ("local" or "peer"); None when none (no rank restored anything then). Every
    rank of the job calls it together."""
    held = node_holdings(files)
    world = files.world_size
    mine = (sorted(held), newer_than)
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    else:
        gathered = [mine]
    newest_ckpt = max(int(g[1]) for g in gathered)
    for plan in plans([g[0] for g in gathered], world, newest_ckpt)[:TRIES]:
        ok = True
        try:
            tree = _fetch(files, plan, held, group)
        except Exception:
            log.exception("snapshot of step %d could not be fetched", plan.step)
            ok = False
        if ok:
            try:
                apply(tree)
            except Exception:
                log.exception("snapshot of step %d could not be restored", plan.step)
                ok = False
        if _everywhere(ok, world, group):
            source = "local" if plan.sources[files.rank] == files.rank else "peer"
            log.info("restored the snapshot of step %d (%s copy)", plan.step, source)
            return plan.step, source
        log.warning("the snapshot of step %d failed on some rank; trying an older one", plan.step)
    return None


def _fetch(
    files: snapshot.Snapshotter, plan: Plan, held: dict[tuple[int, int], Path], group: Any
) -> Any:
    """This rank's tree for `plan`: read here, or received from the rank that holds it (and
    send what other ranks need from this node)."""
    me, step = files.rank, plan.step
    works = []
    for rank in sorted(r for r, src in plan.sources.items() if src == me and r != me):
        path = held.get((rank, step))
        size = path.stat().st_size if path is not None and path.exists() else 0
        header = torch.tensor([size], dtype=torch.int64)
        works.append(snapshot.send(header, rank, group))
        if size:
            assert path is not None
            data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            works.append(snapshot.send(data, rank, group))
    try:
        source = plan.sources[me]
        if source == me:
            return _load(held[(me, step)])
        header = torch.zeros(1, dtype=torch.int64)
        _wait(snapshot.recv(header, source, group))
        size = int(header.item())
        if size <= 0:
            raise FileNotFoundError(f"rank {source} no longer holds rank {me}'s step {step}")
        data = torch.empty(size, dtype=torch.uint8)
        _wait(snapshot.recv(data, source, group))
        return _load(io.BytesIO(data.numpy().tobytes()))
    finally:
        for work in works:
            if work is not None:
                work.wait()


def _wait(work: Any) -> None:
    if work is not None:
        work.wait()


def _load(source: Path | io.BytesIO) -> Any:
    return torch.load(source, map_location="cpu", weights_only=False)


def _everywhere(ok: bool, world: int, group: Any) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    if world > 1:
        snapshot.all_reduce(flag, dist.ReduceOp.MIN, group)
    return int(flag.item()) == 1
