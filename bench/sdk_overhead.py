"""SDK overhead vs no SDK vs torch.profiler on the same 4-rank gloo DDP training loop.

    python bench/sdk_overhead.py [--world 4] [--rounds 40] [--steps 4] [--hidden 128]

The model is a small transformer encoder (hundreds of ops per step, like real models; the
profiler's cost grows with ops, the SDK's only with steps and collectives). The ranks run rounds
of five blocks in a rotating order, so machine noise hits all alike:
  - plain;
  - with the vigil SDK (init + watch + step + collective timing, JSONL output);
  - under torch.profiler (default activities, schedule wait=1 warmup=1 active=3);
  - with torch's own default DDP comm hook alone: the floor of any Python comm hook, which
    timing DDP's all-reduce needs;
  - plain again: an A/A control; its ratio to plain is this machine's noise at this run length.
Each block builds a fresh DDP model (same seed) and discards its first step. Ratios are median
step time with / without (rank 0's clock; synchronous DDP makes ranks agree), printed with a
bootstrap 90 % interval over the measured steps. Progress pages live in /dev/shm, as by
default. The per-collective hook cost is measured on a one-member gloo group (no peers to wait
for), wrapped vs unwrapped, in alternating batches (the fastest batch of each). The SDK's own
CPU per step is measured there too: two models take alternate steps, one watched by the SDK, one
with a bare Python comm hook (sdk_step_cpu_us). Last, all ranks train with the SDK while
py-spy samples rank 0's training thread: the share of its wall time spent in the SDK's own code
(sdk_thread_pct), apart from the division and all-reduce start that DDP does to each bucket
with or without a hook. Machine noise stretches samples in and out of the SDK alike, so this
resolves far below the ratios' noise; it misses indirect costs (caches, the background thread).
Last line: one JSON object with sdk_overhead_ratio, profiler_overhead_ratio, hook_cost_us,
ddp_comm_hook_ratio, sdk_step_cpu_us, sdk_thread_pct and plain_step_ms (the step time the ratios
are of: the SDK's cost is a fixed amount per step and per collective, so its ratio at a step
time T is about that cost over T; larger shapes, e.g. --hidden 256 --seq-len 64 --batch 8, give
quarter-second steps here).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import vigil.agent
from vigil.agent import collectives, stacks

MODES = ("plain", "sdk", "profiler", "ddp_hook", "plain_again")


def _model(hidden: int, layers: int) -> torch.nn.Module:
    """A small pre-norm transformer encoder: hundreds of ops per step, like real models."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        hidden,
        nhead=4,
        dim_feedforward=2 * hidden,
        dropout=0.0,
        batch_first=True,
        norm_first=True,
    )
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class _Handle:
    def set_loss(self, loss: Any) -> None:
        pass


@contextlib.contextmanager
def _no_sdk_step(step: int, *, tokens: int) -> Iterator[_Handle]:
    yield _Handle()


def _block(
    mode: str,
    args: argparse.Namespace,
    tmp: Path,
    pages: Path,
    *,
    steps: int | None = None,
    sampler: _Sampler | None = None,
) -> tuple[list[float], list[float]]:
    """(wall seconds, training-thread CPU seconds) of each measured step; `sampler` runs
    during the measured steps only (not set-up, the first step or shut-down)."""
    steps, batch = steps or args.steps, args.batch
    model = torch.nn.parallel.DistributedDataParallel(_model(args.hidden, args.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    profiler: Any = None
    if mode == "sdk":
        vigil.agent.init(job="bench", output_dir=tmp / "out", progress_dir=pages, peak_flops=1e11)
        vigil.agent.watch(model, opt)
    elif mode == "ddp_hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif mode == "profiler":
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=3)
        profiler = torch.profiler.profile(schedule=schedule)
        profiler.__enter__()
    x = torch.randn(batch, args.seq_len, args.hidden)
    times, cpu = [], []
    step = vigil.agent.step if mode == "sdk" else _no_sdk_step
    for i in range(steps + 1):
        if i == 1 and sampler is not None:
            sampler.start()
        start, start_cpu = time.perf_counter(), time.thread_time()
        with step(i, tokens=batch * args.seq_len) as s:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.set_loss(loss)
        if profiler is not None:
            profiler.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    if sampler is not None:
        sampler.stop()
    if profiler is not None:
        profiler.__exit__(None, None, None)
    if mode == "sdk":
        vigil.agent.shutdown()
    del model, opt
    dist.barrier()
    return times[1:], cpu[1:]  # the first step builds DDP buckets / allocator state


class _Sampler:
    """py-spy sampling this process's training thread (wall clock: idle samples included, and
    the process is never paused), to attribute step time to the code it is spent in."""

    def __init__(self, out: Path, rate: int = 250) -> None:
        self.out = out
        self.rate = rate
        self.error = ""  # start and stop never raise: the other ranks are mid-block
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        spy = stacks.py_spy_path()
        if spy is None:
            self.error = "py-spy is not installed"
            return
        cmd = [spy, "record", "--pid", str(os.getpid()), "--rate", str(self.rate), "--idle"]
        cmd += ["--nonblocking", "--threads", "--full-filenames", "--format", "raw"]
        try:
            self._proc = subprocess.Popen(
                [*cmd, "--output", str(self.out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            self.error = f"cannot run py-spy: {exc}"
            return
        time.sleep(0.5)  # attached before the steps it is to see

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
        try:
            _, err = self._proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            err = b"did not stop"
        if not self.out.exists():
            self.error = f"py-spy wrote no samples: {err.decode(errors='replace')[-300:]}"

    def sdk_shares(self, package: str) -> tuple[float, float, int]:
        """(% of the main thread's samples in the SDK's code beyond a DDP bucket's own work,
        % in that work (dividing the bucket and starting its all-reduce), samples)."""
        if self.error:
            raise RuntimeError(self.error)
        total = sdk = bucket_work = 0
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if not frames[0].endswith("MainThread"):
                continue
            total += int(count)
            ours = [f for f in frames[1:] if f.rpartition("(")[2].startswith(package)]
            if not ours:
                continue
            if ours[-1].partition(" (")[0] in collectives.DDP_BUCKET_WORK:
                bucket_work += int(count)
            else:
                sdk += int(count)
        if not total:
            raise RuntimeError("py-spy sampled no training thread")
        return 100.0 * sdk / total, 100.0 * bucket_work / total, total


def _sdk_thread_pct(args: argparse.Namespace, tmp: Path, pages: Path, rank: int) -> float | None:
    """Rank 0's training-thread wall time inside the SDK's code, sampled (py-spy) while all
    ranks train with the SDK: machine noise stretches a step's samples in and out of the SDK
    alike, so this resolves far below the step-time ratios' noise. The DDP comm hook's division
    and all-reduce start are counted apart: DDP does them with or without a hook. Indirect
    costs (caches, the SDK's background thread) are not in it."""
    sampler = _Sampler(tmp / "sdk.spy") if rank == 0 else None
    try:
        _block("sdk", args, tmp, pages, steps=args.sampled_steps, sampler=sampler)
        if sampler is None:
            return None
        sdk, bucket_work, samples = sampler.sdk_shares(os.path.dirname(vigil.agent.__file__))
    except RuntimeError as exc:  # py-spy missing, or not allowed to read this process
        print(f"sampling the training thread failed: {exc}")
        return None
    print(
        f"sampled {samples} training-thread samples over {args.sampled_steps} SDK steps: "
        f"{sdk:.2f} % in the SDK's code, {bucket_work:.2f} % dividing DDP buckets and starting "
        "their all-reduces (DDP's own work, with or without a hook)"
    )
    return sdk


def _hook_cost_us(tmp: Path, pages: Path, solo: Any, calls: int = 200, repeats: int = 25) -> float:
    t = torch.ones(8)

    def batch() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t, group=solo)
        return (time.perf_counter() - start) / calls

    session = vigil.agent.init(job="hookcost", output_dir=tmp / "out", progress_dir=pages)
    assert session is not None
    recorder = session.recorder
    plain, wrapped = [], []
    for _ in range(repeats):
        collectives.uninstall()
        plain.append(batch())
        collectives.install(recorder)
        wrapped.append(batch())
    vigil.agent.shutdown()
    # The fastest batch of each kind is the one least disturbed by other processes.
    return max(0.0, min(wrapped) - min(plain)) * 1e6


def _bare_hook(process_group: Any, bucket: Any) -> Any:
    """The least a Python DDP comm hook does: divide, all-reduce through the process group."""
    tensor = bucket.buffer()
    tensor.div_(process_group.size())
    return process_group.allreduce([tensor]).get_future().then(lambda fut: fut.value()[0])


_bare_hook.__annotations__ = default_hooks.allreduce_hook.__annotations__


def _sdk_step_cpu_us(
    args: argparse.Namespace, tmp: Path, pages: Path, solo: Any, steps: int = 300
) -> float:
    """The SDK's training-thread CPU per step, in place (caches as cold as training leaves
    them): two identical DDP models on a one-member group take alternate steps, one watched by
    the SDK, the other with a bare Python comm hook; the difference of their median thread CPU
    per step. Rank 0 alone, while the others wait: no contention from other ranks."""
    models = []
    for _ in range(2):
        model = torch.nn.parallel.DistributedDataParallel(
            _model(args.hidden, args.layers), process_group=solo
        )
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4)))
    models[0][0].register_comm_hook(solo, _bare_hook)
    vigil.agent.init(job="stepcost", output_dir=tmp / "out", progress_dir=pages, peak_flops=1e11)
    vigil.agent.watch(*models[1])
    x = torch.randn(args.batch, args.seq_len, args.hidden)
    cpu: list[list[float]] = [[], []]
    for i in range(steps + 1):
        for k in (0, 1) if i % 2 else (1, 0):
            model, opt = models[k]
            start = time.thread_time()
            with (
                vigil.agent.step(i, tokens=x.shape[0] * x.shape[1])
                if k
                else _no_sdk_step(i, tokens=0) as s
            ):
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.set_loss(loss)
            if i:  # the first step builds DDP buckets
                cpu[k].append(time.thread_time() - start)
    vigil.agent.shutdown()
    return (statistics.median(cpu[1]) - statistics.median(cpu[0])) * 1e6


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    tmp = Path(tempfile.mkdtemp(prefix=f"vigil-bench-{rank}-"))
    shm = Path("/dev/shm")
    pages = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp / "pages"
    orders = [MODES[i:] + MODES[:i] for i in range(len(MODES))]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        medians = {}
        for mode in orders[r % len(orders)]:
            block, block_cpu = _block(mode, args, tmp, pages)
            times[mode] += block
            cpu[mode] += block_cpu
            medians[mode] = statistics.median(block)
        rounds.append(medians)
    sdk_pct = _sdk_thread_pct(args, tmp, pages, rank) if args.sampled_steps else None
    # Rank 0 alone measures the hook cost while the others wait: no self-inflicted contention.
    solo = dist.new_group([rank], use_local_synchronization=True)
    hook_us = _hook_cost_us(tmp, pages, solo) if rank == 0 else 0.0
    step_us = _sdk_step_cpu_us(args, tmp, pages, solo) if rank == 0 else 0.0
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(pages, ignore_errors=True)
    if rank == 0:
        _report(times, cpu, rounds, hook_us, step_us, sdk_pct, world)


def _report(
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
    rounds: list[dict[str, float]],
    hook_us: float,
    step_us: float,
    sdk_pct: float | None,
    world: int,
) -> None:
    med = {mode: statistics.median(values) for mode, values in times.items()}
    sdk_ratio = med["sdk"] / med["plain"]
    prof_ratio = med["profiler"] / med["plain"]
    cpu_med = {mode: statistics.median(values) for mode, values in cpu.items()}
    print(f"{world} ranks (gloo, CPU), {len(times['plain'])} measured steps per mode")
    print(
        f"{'mode':<12}{'median step ms':>15}{'ratio':>8}{'90% interval':>18}"
        f"{'thread CPU ms':>15}{'ratio':>8}"
    )
    for mode in MODES:
        low, high = _interval(times[mode], times["plain"])
        print(
            f"{mode:<12}{med[mode] * 1e3:>15.2f}{med[mode] / med['plain']:>8.4f}"
            f"{f'{low:.4f}-{high:.4f}':>18}"
            f"{cpu_med[mode] * 1e3:>15.2f}{cpu_med[mode] / cpu_med['plain']:>8.4f}"
        )
    if sdk_ratio > 1.0:
        print(f"profiler overhead / SDK overhead: {(prof_ratio - 1.0) / (sdk_ratio - 1.0):.1f}x")
    else:
        print("profiler overhead / SDK overhead: n/a (SDK overhead below the noise)")
    paired = {mode: statistics.median(r[mode] / r["plain"] for r in rounds) for mode in MODES[1:]}
    print(
        f"paired per-round wall ratios (drift-cancelling cross-check, {len(rounds)} rounds): "
        + ", ".join(f"{mode} {paired[mode]:.4f}" for mode in MODES[1:])
    )
    print(f"per-collective hook cost: {hook_us:.2f} us")
    print(
        f"SDK cost on the training thread beyond a bare Python DDP hook (rank 0 alone, paired "
        f"steps): {step_us:.0f} us of CPU per step; at a step time T, about {step_us:.0f} us / T"
    )
    print(
        json.dumps(
            {
                "sdk_overhead_ratio": round(sdk_ratio, 4),
                "profiler_overhead_ratio": round(prof_ratio, 4),
                "hook_cost_us": round(hook_us, 2),
                "ddp_comm_hook_ratio": round(med["ddp_hook"] / med["plain"], 4),
                "sdk_step_cpu_us": round(step_us, 1),
                "plain_step_ms": round(med["plain"] * 1e3, 1),
                "sdk_thread_pct": None if sdk_pct is None else round(sdk_pct, 3),
            }
        )
    )


def _interval(with_: list[float], without: list[float], draws: int = 2000) -> tuple[float, float]:
    """Bootstrap 90 % interval of median(with_) / median(without), steps resampled."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(with_), np.asarray(without)
    ratios = [
        np.median(rng.choice(a, a.size)) / np.median(rng.choice(b, b.size)) for _ in range(draws)
    ]
    low, high = np.percentile(ratios, [5, 95])
    return float(low), float(high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    # Many short interleaved blocks: a shared machine's load drifts over seconds, and short
    # blocks spread that drift evenly over the three modes.
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per block")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--sampled-steps",
        type=int,
        default=300,
        help="SDK steps sampled with py-spy for sdk_thread_pct (0: skip)",
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.world, args.port, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, __file__, *sys.argv[1:], "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    quiet = subprocess.DEVNULL
    procs = [
        subprocess.Popen([*base, "--rank", str(r)], env=env, stdout=None if r == 0 else quiet)
        for r in range(args.world)
    ]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"ranks failed: {codes}")


if __name__ == "__main__":
    main()
