"""Collective bus bandwidth (all_reduce, all_gather, reduce_scatter) with nccl-tests' formulas.

`bus_bandwidth` is the pure math of nccl-tests (doc/PERFORMANCE.md): algbw = size / time, and
busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter, where
`size` is the per-rank buffer for all_reduce and the full (n x per-rank) buffer for the gathers
and scatters. `measure` times the collectives on an initialised torch.distributed group (NCCL on
GPUs, gloo on CPUs); `run_local` spawns one process per local GPU (or 2 CPU processes) to do it.
The SDC checksum comparison across ranks also rides on these processes (`sdc.outliers`).
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vigil.kernels import measurement

log = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth correction for `op` over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if op == "all_reduce":
        return 2 * (world_size - 1) / world_size
    if op in ("all_gather", "reduce_scatter"):
        return (world_size - 1) / world_size
    raise ValueError(f"collective op must be one of {OPS}, got {op!r}")


def bus_bandwidth(op: str, *, size_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s; `size_bytes` as nccl-tests counts it (see the module docstring)."""
    if seconds <= 0 or size_bytes < 0:
        raise ValueError(f"need seconds > 0 and size_bytes >= 0, got {seconds}, {size_bytes}")
    return size_bytes / seconds * bus_factor(op, world_size)


@dataclass(frozen=True, kw_only=True)
class CollectiveConfig:
    # Per-rank sizes from 1 MiB (latency shows) to 256 MiB (bandwidth-bound on NVLink).
    sizes: tuple[int, ...] = (1 << 20, 16 << 20, 256 << 20)
    ops: tuple[str, ...] = OPS
    warmup: int = 3
    iters: int = 10
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 4 for s in self.sizes):
            raise ValueError("collective sizes must be >= 4 bytes (one fp32 element)")
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"collective ops must be some of {OPS}, got {self.ops}")
        if self.warmup < 0 or self.iters < 1 or self.timeout_s <= 0:
            raise ValueError("collectives need warmup >= 0, iters >= 1 and timeout_s > 0")


@dataclass(frozen=True, kw_only=True)
class CollectiveFigure:
    op: str
    size_bytes: int  # as nccl-tests counts it
    world_size: int
    seconds: float  # slowest rank's mean time per collective

    @property
    def per_rank_bytes(self) -> int:
        return self.size_bytes if self.op == "all_reduce" else self.size_bytes // self.world_size

    @property
    def algbw_gb_s(self) -> float:
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw_gb_s(self) -> float:
        return (
            bus_bandwidth(
                self.op,
                size_bytes=self.size_bytes,
                seconds=self.seconds,
                world_size=self.world_size,
            )
            / 1e9
        )


def _buffers(op: str, per_rank: int, world: int, device: torch.device) -> Callable[[], Any]:
    n = max(1, per_rank // 4)
    if op == "all_reduce":
        buf = torch.ones(n, device=device)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        src = torch.ones(n, device=device)
        dst = torch.empty(n * world, device=device)
        # torch >= 2.10 names them *_single; older releases only have *_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(dst, src)
    src = torch.ones(n * world, device=device)
    dst = torch.empty(n, device=device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(dst, src)


def size_counted(op: str, per_rank: int, world: int) -> int:
    """The size nccl-tests reports: per-rank buffer (all_reduce) or the gathered whole."""
    n = max(1, per_rank // 4) * 4
    return n if op == "all_reduce" else n * world


def measure(config: CollectiveConfig, device: torch.device) -> list[CollectiveFigure]:
    """Time every op and size on the default group; every rank must call this together."""
    world = dist.get_world_size()
    figures = []
    for op in config.ops:
        for per_rank in config.sizes:
            run = _buffers(op, per_rank, world, device)
            for _ in range(config.warmup):
                run()
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(config.iters):
                run()
            _sync(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / config.iters], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            figures.append(
                CollectiveFigure(
                    op=op,
                    size_bytes=size_counted(op, per_rank, world),
                    world_size=world,
                    seconds=float(elapsed.item()),
                )
            )
    return figures


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True, kw_only=True)
class LocalRun:
    figures: list[CollectiveFigure]
    # Per rank: its SDC checksum, when the workers were asked to compute one.
    checksums: dict[int, int]


def run_local(
    config: CollectiveConfig,
    *,
    world_size: int,
    use_cuda: bool,
    sdc_checksum: Callable[[int], int] | None = None,
) -> LocalRun:
    """Spawn `world_size` processes (NCCL on GPUs 0..n-1, else gloo) and measure on them.

    `sdc_checksum(rank)`, a picklable function, lets each worker compute a checksum that is
    then all-gathered, so ranks (GPUs, or simulated devices on CPU) can be compared.
    """
    if world_size < 2:
        raise ValueError(f"collectives need >= 2 processes, got {world_size}")
    ctx = mp.get_context("spawn")
    results: Any = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="vigil-coll-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, store, use_cuda, config, sdc_checksum, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            outcome = _collect(procs, results, config.timeout_s)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return outcome


def _collect(procs: list[Any], results: Any, timeout_s: float) -> LocalRun:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not results.empty():
            kind, payload = results.get()
            if kind == "error":
                raise RuntimeError(f"collective worker failed: {payload}")
            figures, checksums = payload
            return LocalRun(figures=figures, checksums=checksums)
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"collective worker exited with {[p.exitcode for p in procs]}")
        time.sleep(0.05)
    raise TimeoutError(f"collectives did not finish within {timeout_s:.0f} s")


def _worker(
    rank: int,
    world: int,
    store_path: str,
    use_cuda: bool,
    config: CollectiveConfig,
    sdc_checksum: Callable[[int], int] | None,
    results: Any,
) -> None:
    try:
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            store=dist.FileStore(store_path, world),  # type: ignore[attr-defined]
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=config.timeout_s),
        )
        try:
            figures = measure(config, device)
            checksums: dict[int, int] = {}
            if sdc_checksum is not None:
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, sdc_checksum(rank))
                checksums = dict(enumerate(gathered))
            if rank == 0:
                results.put(("ok", (figures, checksums)))
            # A rank that reached the interpreter's exit while gloo's worker still had to drop
            # its last collective's tensors (which takes the GIL) aborted; the barrier's wait
            # hands the GIL over first.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which raises it with context
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def measurements(figures: list[CollectiveFigure]) -> list[measurement.Measurement]:
    """One busbw figure per op and size: e.g. `coll.all_reduce.256MiB.busbw` in GB/s."""
    return [
        measurement.Measurement(
            test=f"coll.{f.op}.{_size_name(f.per_rank_bytes)}.busbw",
            value=f.busbw_gb_s,
            unit="GB/s",
            note=f"algbw {f.algbw_gb_s:.2f} GB/s over {f.world_size} ranks",
        )
        for f in figures
    ]


def _size_name(per_rank: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if per_rank >= 1 << shift and per_rank % (1 << shift) == 0:
            return f"{per_rank >> shift}{unit}"
    return f"{per_rank}B"
