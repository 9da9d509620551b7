"""Where one rank's SDK session keeps its things, and how it opens and lets go of them.

Its progress page and liveness lock in the run's folder (`rundir.py`), its records' sink (JSONL
files, the collector through a spooling outbox, or both), its stack-dump file, and the records
that say who it is. `Session` calls these once at start and once at a clean end: nothing here
runs per step. Must not raise into training beyond what `Session`'s callers already guard.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import time
from pathlib import Path
from typing import IO

from vigil import outbox, schema, spool
from vigil.agent import config, progress, rundir, sinks
from vigil.env import EnvVar

log = logging.getLogger(__name__)


def writes_jsonl(cfg: config.SdkConfig) -> bool:
    return not cfg.collector or cfg.also_jsonl


def output_dir(cfg: config.SdkConfig) -> Path:
    """This job's JSONL folder: `<output_dir>/<job>`."""
    return (cfg.output_dir or Path("vigil-output")) / cfg.job


def own_spool(cfg: config.SdkConfig, run_dir: Path) -> Path:
    """The rank's spool for batches the collector has not taken (the user's, if configured)."""
    return cfg.spool_dir or run_dir / f"{cfg.rank_tag}{spool.SPOOL_SUFFIX}"


def open_page(
    cfg: config.SdkConfig, run_dir: Path, run_id: str
) -> tuple[progress.PageWriter, int | None]:
    """The rank's progress page in `run_dir`, with the run's manifest, and the lock held for the
    process's life from before the page is visible (the agent's liveness signal, valid across
    PID namespaces: `rundir.page_alive`). Returns the page and the lock's descriptor (None: another
    live process holds it, or it could not be made)."""
    for attempt in range(3):  # the agent may expire a dead earlier attempt's folder meanwhile
        lock_fd: int | None = None
        rundir.make_dir(run_dir)
        page = run_dir / f"{cfg.rank_tag}{progress.PAGE_SUFFIX}"
        try:
            rundir.write_manifest(
                run_dir,
                job=cfg.job,
                run=run_id,
                output_dir=output_dir(cfg) if writes_jsonl(cfg) else None,
                pod=cfg.pod,
            )
            lock_fd = rundir.hold_lock(rundir.lock_path(page))
            writer = progress.PageWriter(
                page,
                job=cfg.job,
                node=cfg.node,
                rank=cfg.rank,
                world_size=cfg.world_size,
                local_rank=cfg.local_rank,
                capacity=cfg.ring_capacity,
                pid_ns=rundir.pid_namespace(),
            )
            return writer, lock_fd
        except FileNotFoundError:  # the folder went, and our lock file with it
            if lock_fd is not None:
                rundir.drop_lock(lock_fd)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def make_sink(cfg: config.SdkConfig, run_dir: Path) -> tuple[sinks.Sink, outbox.Outbox | None]:
    """Where records go, and the collector's outbox when they go there."""
    if not cfg.collector:
        return jsonl_sink(cfg), None
    shipper = outbox.Outbox(
        config.ShipperConfig(
            collector_url=cfg.collector,
            spool_dir=own_spool(cfg, run_dir),
            token=cfg.token,
            spool_max_bytes=cfg.spool_max_bytes,
            max_server_errors=cfg.max_server_errors,
        ),
        source=f"{cfg.node}/{cfg.rank_tag}",
    )
    if not cfg.also_jsonl:
        return shipper, shipper
    # The local copy first: a collector that is slow to answer holds a POST for its timeout.
    return sinks.TeeSink(jsonl_sink(cfg), shipper), shipper


def jsonl_sink(cfg: config.SdkConfig) -> sinks.JsonlSink:
    # One file per attempt under a restarting launcher (vigil run, torchrun): a restarted
    # rank never appends to the attempt before it, and `vigil analyze` tells them apart.
    attempt = os.environ.get(EnvVar.RESTART_COUNT) or os.environ.get(
        "TORCHELASTIC_RESTART_COUNT", "0"
    )
    tag = f".attempt-{attempt}" if attempt.isdigit() and int(attempt) > 0 else ""
    return sinks.JsonlSink(output_dir(cfg) / f"{cfg.rank_tag}{tag}.jsonl")


def open_stacks_file(cfg: config.SdkConfig, run_dir: Path) -> IO[str] | None:
    """The file `cfg.stack_signal` dumps every thread's stack into (None: no signal set)."""
    if not cfg.stack_signal:
        return None
    path = run_dir / f"{cfg.rank_tag}{rundir.STACKS_SUFFIX}"
    handle = open(path, "a")  # noqa: SIM115 - faulthandler writes to it until shutdown
    try:
        faulthandler.register(cfg.stack_signal, file=handle, all_threads=True)
    except (ValueError, RuntimeError) as exc:  # not the main interpreter, odd platform
        log.warning("cannot register stack dumps on signal %d: %s", cfg.stack_signal, exc)
    return handle


def identity(
    cfg: config.SdkConfig, *, device_uuid: str, device_kind: str, peak_flops: float
) -> list[schema.RankInfo | schema.Job]:
    """The records that say who this rank is (and, from rank 0, what the job is)."""
    out: list[schema.RankInfo | schema.Job] = [
        schema.RankInfo(
            job_id=cfg.job,
            rank=cfg.rank,
            node=cfg.node,
            local_rank=cfg.local_rank,
            pid=os.getpid(),
            pod=cfg.pod,
            device_uuid=device_uuid,
            world_size=cfg.world_size,
        )
    ]
    if cfg.rank == 0:
        out.append(
            schema.Job(
                job_id=cfg.job,
                name=cfg.job,
                world_size=cfg.world_size,
                model=cfg.model_shape,
                device_kind=device_kind,
                peak_flops=peak_flops,
                created_s=time.time(),
            )
        )
    return out


def release(cfg: config.SdkConfig, run_dir: Path, page: Path, lock_fd: int | None) -> None:
    """A clean end: this rank's page and stacks go (a failed rank's stay as the agent's
    evidence), its spool when drained; the last local rank of the run removes the folder.
    The lock goes last, whatever happened."""
    own = [page, page.with_suffix(rundir.STACKS_SUFFIX)]
    if cfg.spool_dir is None:  # a spool the user placed elsewhere is theirs
        own += spool.siblings(own_spool(cfg, run_dir))
    own.append(rundir.lock_path(page))  # last: held until the page is gone
    me = os.getpid()

    def alive(pid: int) -> bool:
        return pid != me and rundir.pid_alive(pid)

    try:
        rundir.release(run_dir, own=own, alive=alive)
    except OSError as exc:
        log.warning("cannot clean up the progress folder %s: %s", run_dir, exc)
    finally:
        if lock_fd is not None:
            rundir.drop_lock(lock_fd)
