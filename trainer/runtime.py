"""Process-level set-up for a training rank: read the launcher's environment, pick the device
and backend, create the process group through a per-attempt PrefixStore, run the trainer, and
tear down in the order that keeps gloo from hanging at exit.

Launchers: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RESTART_COUNT), vigil's supervisor (the same plus VIGIL_RESTART_COUNT and
VIGIL_STORE_HOSTED) or nothing (one process, no process group). Restarted gloo workers cannot
reconnect through keys an earlier attempt left in a store, so every attempt's rendezvous lives
under its own prefix. This module must not decide anything about training itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from vigil.env import EnvVar
from vigil.trainer import faults, loop, recipes, telemetry

log = logging.getLogger(__name__)

# Per-device dense peak FLOP/s for bf16 from vendor datasheets (no sparsity); MFU's denominator.
GPU_PEAK_BF16: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; PCIe parts are lower (756 TFLOP/s)
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restart_count: int = 0
    store_hosted: bool = False  # the supervisor hosts the TCPStore; rank 0 is a client too

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if self.restart_count < 0:
            raise ValueError(f"restart count must be >= 0, got {self.restart_count}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if env is None else env

        def number(name: str, default: int) -> int:
            raw = env.get(name, "")
            try:
                return int(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name}={raw!r} must be an integer") from None

        restart = env.get(EnvVar.RESTART_COUNT) or env.get("TORCHELASTIC_RESTART_COUNT") or "0"
        hosted = env.get(EnvVar.STORE_HOSTED) or env.get("TORCHELASTIC_USE_AGENT_STORE") or ""
        world = number("WORLD_SIZE", 1)
        return cls(
            rank=number("RANK", 0),
            world_size=world,
            local_rank=number("LOCAL_RANK", 0),
            local_world_size=number("LOCAL_WORLD_SIZE", world),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=number("MASTER_PORT", 29500),
            restart_count=int(restart) if restart.isdigit() else 0,
            store_hosted=hosted.lower() in ("1", "true", "yes"),
        )


def pick_device(
    launch: LaunchEnv, *, force_cpu: bool, cpu_threads: int | None = None
) -> torch.device:
    if torch.cuda.is_available() and not force_cpu:
        torch.cuda.set_device(launch.local_rank)
        return torch.device("cuda", launch.local_rank)
    # Share the host's cores among the ranks on it instead of oversubscribing them; on a busy
    # shared host OpenMP threads spin-wait on each other and 1 thread per rank is far faster.
    threads = cpu_threads or max(1, (os.cpu_count() or 1) // max(1, launch.local_world_size))
    torch.set_num_threads(threads)
    return torch.device("cpu")


def peak_flops_for(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_BF16.items():
        if key in name:
            return peak
    log.warning("no peak FLOP/s known for %s; pass --peak-flops for MFU", name)
    return None


def init_process_group(
    launch: LaunchEnv, device: torch.device, *, timeout: datetime.timedelta
) -> None:
    """The default group, rendezvoused under this attempt's own store prefix."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        launch.master_addr,
        launch.master_port,
        launch.world_size,
        is_master=launch.rank == 0 and not launch.store_hosted,
        timeout=timeout,
        wait_for_workers=False,
    )
    attempt_prefix = f"vigil/attempt-{launch.restart_count}"
    prefixed = dist.PrefixStore(attempt_prefix, store)  # type: ignore[attr-defined]
    # CPU collectives (control all-reduce, checkpoint planning) go over gloo even on GPUs.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        store=prefixed,
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timeout,
        **kwargs,  # type: ignore[arg-type]
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
    job_id: str = "vigil-train"
    force_cpu: bool = False
    cpu_threads: int | None = None  # intra-op threads per CPU rank; None = cores / local ranks
    collective_timeout_s: float = 300.0  # long enough for a slow checkpoint, short enough to fail
    faults_spec: str = ""
    metrics_path: Path | None = None
    peak_flops: float | None = None
    telemetry: bool = True
    collector: str | None = None
    output_dir: Path | None = None
    stop_after: int | None = None

    def __post_init__(self) -> None:
        if self.collective_timeout_s <= 0:
            raise ValueError("collective timeout must be positive")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")


def run(recipe: recipes.Recipe, options: RunOptions, launch: LaunchEnv | None = None) -> int:
    """Train one rank to completion; returns the process exit code."""
    launch = launch or LaunchEnv.from_env()
    plan = faults.parse(options.faults_spec or os.environ.get(EnvVar.FAULTS, ""))
    recipe.validate_world(launch.world_size)
    device = pick_device(launch, force_cpu=options.force_cpu, cpu_threads=options.cpu_threads)
    timeout = datetime.timedelta(seconds=options.collective_timeout_s)
    if launch.world_size > 1:
        init_process_group(launch, device, timeout=timeout)
    ctx = loop.RunContext(
        rank=launch.rank,
        world_size=launch.world_size,
        device=device,
        restart_count=launch.restart_count,
        job_id=options.job_id,
        metrics_path=options.metrics_path,
        peak_flops=options.peak_flops or peak_flops_for(device),
    )
    tele = telemetry.Telemetry(enabled=options.telemetry)
    tele.start(
        job=options.job_id,
        rank=launch.rank,
        world_size=launch.world_size,
        model_shape=recipe.model.shape(recipe.seq_len),
        flops_per_token=recipe.model.flops_per_token(recipe.seq_len),
        peak_flops=ctx.peak_flops,
        output_dir=options.output_dir,
        collector=options.collector,
    )
    trainer = loop.Trainer(recipe, ctx=ctx, fault_plan=plan, tele=tele)
    previous = signal.signal(signal.SIGTERM, trainer.control.request_stop)
    try:
        result = trainer.train(stop_after=options.stop_after)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # Only a clean run tears down in order; after an error peers may be gone and a destroy
    # could block, so the caller exits the process instead.
    trainer.close()  # releases model and optimizer before the group goes (gloo exit hang)
    del trainer
    if dist.is_initialized():
        _end_process_group()
    return int(result.exit_code)


def _end_process_group() -> None:
    """Every rank meets, then the groups go: a clean rank's orderly teardown.

    A gloo worker thread drops its last reference to a finished collective's tensors only
    after the caller's wait returned, and it needs the GIL to do so. A rank with nothing left
    to do (rank 1 after the last checkpoint's closing broadcast, while rank 0 commits) could
    reach the interpreter's finalization first; the worker then died taking the GIL and the
    rank aborted ("terminate called without an active exception", 3 runs in 50). Waiting in
    a barrier hands the GIL over: 0 aborts in 105 runs. A barrier that fails (a peer gone)
    leaves the groups to the process's exit, since destroying them then could block.
    """
    try:
        dist.barrier()
    except RuntimeError as exc:  # DistError (a peer gone) subclasses it
        log.warning("not every rank reached the end of the job (%s): no teardown", exc)
        return
    dist.destroy_process_group()
