"""The public per-step snapshot API for any training loop (also `vigil.agent.snapshots`):

    snaps = vigil.agent.snapshots(model, optimizer, extra={"sched": scheduler}, rng=True)
    start = snaps.restore() or 0          # the first step to train
    for step in range(start, steps):
        train_step(step)                  # forward, backward, optimizer.step()
        snaps.save(step)                  # stages a copy and returns; written in the background
    snaps.close()

Under `vigil run` (VIGIL_SNAPSHOT_DIR, VIGIL_JOB and VIGIL_NODE set for every rank) nothing else
is needed; elsewhere pass `root=` or it does nothing (restore returns None, save returns False).
Model and optimizer state go through torch.distributed.checkpoint's `get_state_dict` /
`set_state_dict`, so plain modules, DDP and FSDP2 (DTensor shards, kept as this rank's local
pieces: a snapshot restores into the same layout) work alike, over gloo and NCCL. `extra` holds
anything with `state_dict()` / `load_state_dict()` (LR schedulers, stateful samplers and data
loaders); `rng=True` adds the torch (CPU and CUDA), Python and NumPy generators. A user who also
saves checkpoints passes the newest one's step to `restore(checkpoint_step=...)` and gets the
newer of the two. The bundled trainer uses this same class. Hooks never raise into training.
Construct it on every rank at the same point (it creates two gloo groups of its own).
"""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from vigil.recovery import snapshot, snapshot_async, snapshot_restore

log = logging.getLogger(__name__)

FORMAT = 1  # the snapshot tree's layout version


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class Snapshots:
    """Per-step in-memory snapshots of one rank's model, optimizer and extra state."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: Mapping[str, Stateful] | None = None,
        rng: bool = False,
        job: str | None = None,
        root: str | os.PathLike[str] | None = None,
        keep: int = 2,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.extra = dict(extra or {})
        for name, obj in self.extra.items():
            if not callable(getattr(obj, "state_dict", None)) or not callable(
                getattr(obj, "load_state_dict", None)
            ):
                raise TypeError(f"extra[{name!r}] has no state_dict()/load_state_dict()")
        if optimizer is not None and model is None:
            raise ValueError("an optimizer needs its model: pass model= as well")
        self.rng = rng
        self.files = snapshot.from_env(job=job, root=root, keep=keep)
        self.writer = (
            snapshot_async.BackgroundSnapshotter.create(self.files) if self.files else None
        )
        # Where the state of the last restore came from: "local" (this node's shared memory),
        # "peer" (the replica another node kept), None (nothing restored).
        self.restored_from: str | None = None
        self._hook = None
        if self.writer is not None and optimizer is not None:
            self._hook = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        if self.writer is not None:
            self.writer.before_update()

    @property
    def enabled(self) -> bool:
        return self.writer is not None

    @property
    def stats(self) -> snapshot_async.SnapshotStats:
        """Counters: saved, skipped (one was in flight), failed, stall and write seconds."""
        return self.writer.stats if self.writer else snapshot_async.SnapshotStats()

    # ----- saving -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """This rank's previous snapshot is written (see `save`'s `all_ready`)."""
        return self.writer.ready if self.writer is not None else False

    def save(self, step: int, *, all_ready: bool | None = None) -> bool:
        """Snapshot the state after `step` (every rank calls it for the same steps). Returns at
        once; False when skipped (the previous snapshot is still being written) or off.

        Every rank must decide alike whether to skip: by default one small all-reduce of a gloo
        group of its own does. A loop that all-reduces something every step anyway (its loss)
        can carry `ready` in it and pass the result as `all_ready` (the bundled trainer does)."""
        if self.writer is None:
            return False
        return self.writer.save(step, self._capture, all_ready=all_ready)

    def _capture(self) -> tuple[dict[str, Any], Any]:
        return self.state(), self._deferred()

    def state(self) -> dict[str, Any]:
        """The tree a snapshot holds (live tensors; staging copies them)."""
        world = self.files.world_size if self.files is not None else 1
        tree: dict[str, Any] = {"format": FORMAT, "world_size": world}
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            optimizers = [self.optimizer] if self.optimizer is not None else []
            tree["model"], tree["optim"] = get_state_dict(self.model, optimizers)
        tree["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        if self.rng:
            tree["rng"] = rng_state()
        return tree

    def _deferred(self) -> Any:
        """Tensors only the optimizer changes: copied in the background before its next step."""
        if self.optimizer is None or self.model is None:
            return lambda _t: False
        ptrs = {_local(p).data_ptr() for p in self.model.parameters()}
        for state in self.optimizer.state.values():
            ptrs.update(_local(v).data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        ptrs.discard(0)
        return lambda t: t.data_ptr() in ptrs

    # ----- restoring ----------------------------------------------------------------------
    def restore(self, *, checkpoint_step: int | None = None) -> int | None:
        """Restore the newest snapshot every rank holds (its own node's, else the peer's
        replica) that is newer than `checkpoint_step` (the step your newest checkpoint holds,
        when you save them too). Returns the first step to train after it, or None when there
        is no such snapshot (then load your checkpoint, or start from step 0). All ranks call
        it together and restore the same step."""
        if self.writer is None or self.files is None:
            return None
        newer_than = -1 if checkpoint_step is None else checkpoint_step
        found = snapshot_restore.restore(
            self.files, self.load, newer_than=newer_than, group=self.writer.agree_group
        )
        if found is None:
            return None
        step, self.restored_from = found
        return step + 1

    def load(self, saved: Mapping[str, Any]) -> None:
        """Put a snapshot tree (from `state`) back into the registered objects."""
        if saved.get("format") != FORMAT:
            raise ValueError(f"snapshot format {saved.get('format')!r}; this vigil reads {FORMAT}")
        world = self.files.world_size if self.files is not None else 1
        if saved.get("world_size", world) != world:
            raise ValueError(
                f"snapshot of a {saved['world_size']}-rank job; this one has {world} ranks "
                "(a resized job resumes from its checkpoint)"
            )
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            optimizers = [self.optimizer] if self.optimizer is not None else []
            model_sd, optim_sd = get_state_dict(self.model, optimizers)
            live = snapshot.restore_local(
                {"model": model_sd, "optim": optim_sd},
                {"model": saved["model"], "optim": saved["optim"]},
            )
            set_state_dict(
                self.model,
                optimizers,
                model_state_dict=live["model"],
                optim_state_dict=live["optim"] if optimizers else {},
            )
        for name, obj in self.extra.items():
            if name not in saved["extra"]:
                raise ValueError(f"snapshot has no extra state {name!r}")
            obj.load_state_dict(saved["extra"][name])
        if self.rng and "rng" in saved:
            set_rng_state(saved["rng"])

    def flush(self, timeout_s: float = snapshot_async.CLOSE_TIMEOUT_S) -> bool:
        """Wait until the snapshot in flight is written and replicated; False on timeout."""
        return self.writer.flush(timeout_s) if self.writer is not None else True

    def close(self, timeout_s: float = snapshot_async.CLOSE_TIMEOUT_S) -> None:
        """Wait for the snapshot in flight, then stop the background thread."""
        if self.writer is not None:
            self.writer.close(timeout_s)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def snapshots(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> Snapshots:
    """`Snapshots(model, optimizer, **options)`: the SDK's one-line entry point."""
    return Snapshots(model, optimizer, **options)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
