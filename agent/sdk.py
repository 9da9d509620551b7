"""The public SDK: a few calls in any PyTorch training loop.

    vigil.agent.init(job="gpt-7b")
    vigil.agent.watch(model, optimizer)
    vigil.agent.label_group(my_tp_group, "tp")  # groups made by hand; DeviceMesh dims are named
    for i, batch in enumerate(loader):
        with vigil.agent.step(i, tokens=batch.numel()) as s:
            loss = train_step(batch)
            s.set_loss(loss)
    vigil.agent.shutdown()

Every function is fail-open (logs and counts its own errors, never raises into training) and a
cheap no-op before `init`. Rank and world size come from torch.distributed when it is initialised,
else from RANK / WORLD_SIZE / LOCAL_RANK (torchrun). This module holds the one process-wide
session and nothing else.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from vigil import codec, schema
from vigil.agent import config, groups, session
from vigil.env import EnvVar

log = logging.getLogger(__name__)

_session: session.Session | None = None
CONTROL_KINDS = ("checkpoint", "dump_stacks")


class FromEnvironment(enum.Enum):
    """The type of `FROM_ENV`: "take this setting from the environment" (None means none)."""

    FROM_ENV = "from the environment"

    def __repr__(self) -> str:
        return "vigil.agent.sdk.FROM_ENV"


# `init(collector=...)`'s default: $VIGIL_COLLECTOR_URL when set; None means no collector at all.
FROM_ENV = FromEnvironment.FROM_ENV


def _identity(rank: int | None, world_size: int | None) -> tuple[int, int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world_size, local_rank


def init(
    *,
    job: str,
    collector: str | FromEnvironment | None = FROM_ENV,
    output_dir: str | os.PathLike[str] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    node: str | None = None,
    model_shape: schema.ModelShape | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    **more_keyword_options: Any,
) -> session.Session | None:
    """Start this process's session (idempotent: a second call returns the first session).

    `collector`: the collector's URL; None: no collector, whatever the environment says; left
    out (`FROM_ENV`): $VIGIL_COLLECTOR_URL when set, else none. Without one, JSON lines go under
    `output_dir` (default $VIGIL_OUTPUT_DIR, else ./vigil-output). More options are `SdkConfig`
    fields (progress_dir, run_id, ring_capacity, flush_interval_s, measure_flops, ...).

    Progress pages, stack dumps and (with a collector) the spool live in this run's folder
    `<progress_dir>/<job>/<run_id>/`: `progress_dir` defaults to $VIGIL_PROGRESS_DIR, else
    /dev/shm/vigil; `run_id` to $VIGIL_RUN_ID, else torchrun's run id, MASTER_ADDR:MASTER_PORT,
    the pid (one process alone) or the process group (`vigil.agent.rundir.run_id`). A clean
    `shutdown()` removes the folder once the run's last local rank is done; batches still
    spooled there stay for the node agent to send.

    Fail-open: bad options or a failing start are logged as errors and return None; training
    runs on without vigil.
    """
    global _session
    if _session is not None:
        log.warning("vigil.agent.init called twice; keeping the first session")
        return _session
    try:
        cfg = _config(
            job,
            collector,
            output_dir,
            rank,
            world_size,
            node,
            model_shape,
            flops_per_token,
            peak_flops,
            more_keyword_options,
        )
    except (ValueError, TypeError) as exc:
        log.error("vigil SDK not started, bad configuration: %s", exc)
        return None
    try:
        _session = session.Session(cfg)
    except Exception:
        log.exception("vigil SDK failed to start; training continues without it")
        return None
    log.info("vigil SDK: job %s rank %d/%d on %s", cfg.job, cfg.rank, cfg.world_size, cfg.node)
    return _session


def _config(
    job: str,
    collector: str | FromEnvironment | None,
    output_dir: str | os.PathLike[str] | None,
    rank: int | None,
    world_size: int | None,
    node: str | None,
    model_shape: schema.ModelShape | None,
    flops_per_token: float | None,
    peak_flops: float | None,
    more_keyword_options: dict[str, Any],
) -> config.SdkConfig:
    rank, world_size, local_rank = _identity(rank, world_size)
    env_out = os.environ.get(EnvVar.OUTPUT_DIR)
    more_keyword_options.setdefault("local_rank", local_rank)
    if collector is FROM_ENV:
        collector = os.environ.get(EnvVar.COLLECTOR_URL) or None
    elif collector is not None and not isinstance(collector, str):
        raise TypeError(f"collector must be a URL, None or left out, not {collector!r}")
    return config.SdkConfig(
        job=job,
        rank=rank,
        world_size=world_size,
        node=node or config.default_node(),
        collector=collector or None,
        token=more_keyword_options.pop("token", None) or os.environ.get(EnvVar.TOKEN),
        output_dir=Path(output_dir) if output_dir else Path(env_out) if env_out else None,
        model_shape=model_shape,
        flops_per_token=flops_per_token,
        peak_flops=peak_flops,
        **more_keyword_options,
    )


def current() -> session.Session | None:
    """The running session, or None before `init` / after `shutdown`."""
    return _session


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Time forward, backward and optimizer phases (and DDP's all-reduce through a comm hook;
    and `torch.distributed.pipelining` schedules' `step` where the process has imported them)."""
    if _session is None:
        return
    try:
        _session.watch(model, optimizer)
    except Exception as exc:
        _session.count_error(exc)


def step(step: int, *, tokens: int = 0) -> session.StepScope:
    """Mark one training step (`with vigil.agent.step(i, tokens=n) as s:`); the handle's
    `.set_loss(x)` attaches the loss."""
    return session.StepScope(_session, session.StepHandle(step, tokens))


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Time a custom phase ("data", "checkpoint", ...) inside or between steps."""
    current_session = _session
    if current_session is None:
        yield
        return
    try:
        manager = current_session.span(name)
        manager.__enter__()
    except Exception as exc:
        current_session.count_error(exc)
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            manager.__exit__(None, None, None)


def label_group(group: Any, label: str) -> None:
    """Name a process group by what it is (`label_group(tp_group, "tp")`): its collectives are
    then recorded as `<label>:<id>` and findings say "the tp group of node-3 (ranks 4-7)".

    Call it with the same label on every member rank, before or after `init`, ideally before
    the group's first collective (ops already recorded keep their old name). DeviceMesh groups
    are labelled by their dimension names without it. Bad input is the caller's mistake and
    raises: TypeError when `group` is not a ProcessGroup, ValueError for the default group or a
    label that is empty, longer than 16 characters, holds characters other than letters,
    digits, '_', '-', '.', or is reserved ('world', 'pg')."""
    if not groups.set_label(group, label):
        return
    if _session is None:
        return
    try:
        _session.recorder.forget_group(group)
    except Exception as exc:
        _session.count_error(exc)


def on_control(kind: str, callback: Callable[[], Any]) -> None:
    """Run `callback()` in the training thread at the next step boundary after a `kind` request."""
    if kind not in CONTROL_KINDS:
        log.warning("control kind %r is not one of %s; registering anyway", kind, CONTROL_KINDS)
    if _session is None:
        return
    try:
        _session.on_control(kind, callback)
    except Exception as exc:
        _session.count_error(exc)


def checkpoint_committed(
    step: int,
    *,
    location: str,
    num_bytes: int = 0,
    save_s: float = 0.0,
    blocked_s: float = 0.0,
    verified: bool = False,
) -> None:
    """Report that the checkpoint of `step` committed at `location` (call it once, on one rank,
    after the commit marker is written). It ships as a `Checkpoint` record: the recovery
    controller's "checkpoint now" counts a checkpoint as taken only once this reaches the
    collector (an acknowledged request says only that the job saw it)."""
    current_session = _session
    if current_session is None:
        return
    try:
        record = schema.Checkpoint(
            job_id=current_session.cfg.job,
            step=step,
            location=location,
            bytes=num_bytes,
            save_s=save_s,
            blocked_s=blocked_s,
            verified=verified,
            committed_s=time.time(),
        )
        # Checked here as the collector would (a negative step, an empty location): a record
        # it refuses would cost the whole batch it ships in.
        codec.decode_json(codec.encode_json(record))
        current_session.queue.put(record)
        current_session.flusher.flush_soon()
    except Exception as exc:
        current_session.count_error(exc)


def shutdown() -> None:
    """Flush everything, mark the rank finished and remove the hooks (idempotent).

    Called while an exception propagates (a `finally:` around the training loop) or is being
    handled, the rank is marked failed instead: that is how its peers' crash is told apart from
    a clean end; terminated where Ctrl-C (KeyboardInterrupt, or any error once SIGINT came)
    stops it. A process that exits without calling it is marked the same way at exit."""
    global _session
    current_session, _session = _session, None
    if current_session is None:
        return
    try:
        current_session.shutdown(current_session.last_word(sys.exc_info()[1]))
    except Exception:
        log.exception("vigil SDK shutdown failed (training is unaffected)")
