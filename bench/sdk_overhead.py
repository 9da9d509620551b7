"""SDK overhead vs no SDK vs torch.profiler on the same 2-rank gloo DDP training loop.

    python bench/sdk_overhead.py            # the full run, 9-11 minutes on 2 cores
    python bench/sdk_overhead.py --quick    # a smoke run, under a minute

Two ranks (one per core of a 2-core machine) train one model, a small pre-norm transformer
encoder (hidden 256, 4 layers: hundreds of ops per step, like real models; the profiler's cost
grows with ops, the SDK's only with steps and collectives), on two workloads that differ only
in their input, so that the model, its DDP buckets and its ops are the same in both:
  - "250ms": seq-len 128, batch 10 (plain steps take about 250 ms here);
  - "40ms": seq-len 32, batch 4 (about 40 ms).
(`--workload NAME=HIDDENxSEQxBATCH`, repeated, replaces them; the first is the headline.)

Step time. Each round runs, on both workloads, five blocks, all ten in a shuffled order (the
same on every rank, a new one each round), so machine noise hits every mode and workload alike:
  - plain;
  - with the vigil SDK (init + watch + step + collective timing, JSONL output);
  - under torch.profiler (default activities, schedule wait=1 warmup=1 active=3);
  - with torch's own default DDP comm hook alone (it divides each bucket on the training
    thread before the all-reduce): what a Python comm hook, which timing DDP's all-reduce
    needs, costs when it averages that way;
  - plain again: an A/A control; its ratio to plain is this machine's noise at this run length.
Each block builds a fresh DDP model (same seed) and discards its first step. Ratios are median
step time with / without (rank 0's clock; synchronous DDP makes ranks agree), per workload,
printed with a bootstrap 90 % interval over the measured steps, beside the median of per-round
ratios (a drift-cancelling cross-check). Progress pages live in /dev/shm, as by default.

CPU per step, in place. On the last workload ("40ms": the same model and ops as "250ms", and
its shorter steps resolve a fixed cost better), rank 0 alone, on a one-member gloo group while
the other ranks wait, trains five DDP models of that workload: three bare ones (no comm hook at
all: DDP's C++ all-reduce), one watched by the SDK (its cost thus includes its Python comm
hook) and one with torch's own default comm hook alone. A cycle is one step of each in a
shuffled order: bare models A and B, the SDK's model, the third bare model under
torch.profiler (default activities: CPU here; started before that step and stopped after it,
outside its timing) and the default hook's model. A model of its own each: every model's
state is as cold in the caches as the others'. Two models built alike differ by hundreds of
µs a step for as long as they live (where their memory lies; the order a set is built in may
place it), so a fresh set is built every 25 cycles, its models in a new shuffled order each
time (its first cycle, which builds DDP's buckets, not measured), and the intervals below
resample whole sets, not cycles. Per cycle, a step's training-thread CPU
(time.thread_time) less the mean of the two bare steps' is that step's extra cost; the medians
over cycles are sdk_step_cpu_us and profiler_step_cpu_us (with bootstrap 90 % intervals), and
sdk_cpu_share_of_profiler is their ratio. B less A (cpu_aa_us) is the method's own noise.
The default hook's extra cost (hook_floor_step_cpu_us) is what a Python comm hook costs the
training thread when it divides the bucket there: DDP's C++ path folds the averaging into its
copy of the gradients into the bucket, while torch's default hook divides the bucket in a pass
of its own before the all-reduce (on CPU ranks a pass over every gradient byte; on GPUs one
kernel launch). The SDK's hook divides a summed bucket in its completion callback instead, on
gloo's thread, while backward goes on (NCCL averages in its kernel): that pass is in
sdk_other_threads_cpu_us, not in sdk_step_cpu_us. sdk_beyond_floor_cpu_us is the SDK's cost
less the default hook's, per cycle (its share of the profiler's:
sdk_beyond_floor_share_of_profiler). All threads together, the SDK's CPU per step (training
thread + other threads + its flusher) and the profiler's (training thread + other threads + its
stop) are sdk_all_threads_cpu_us and profiler_all_threads_cpu_us, their ratio
sdk_all_threads_share_of_profiler.
Not in those figures, printed beside them: each kind's extra CPU on the process's other
threads, less the SDK's own threads (for the SDK: its comm hook's completion callbacks, which
gloo runs on its threads: sdk_other_threads_cpu_us; profiler_other_threads_cpu_us), the SDK's
flusher thread over the phase per SDK step (sdk_background_cpu_us, at that step rate), and the
profiler's stop, which collects the step's events on the training thread (profiler_stop_cpu_us,
per profiled step; a schedule with active=3 spreads it over three steps).

Also: the per-collective hook cost on a one-member group, wrapped vs unwrapped, in alternating
batches (the fastest batch of each: hook_cost_us); and all ranks training the last workload
with the SDK while py-spy samples rank 0's training thread: the share of its wall time spent in
the SDK's own code (sdk_thread_pct), apart from the division and all-reduce start that DDP does
to each bucket with or without a hook. Machine noise stretches samples in and out of the SDK
alike, so this resolves far below the ratios' noise; it misses indirect costs (caches, the
background thread).

Targets: sdk_overhead_ratio (the "250ms" workload's) <= 1.01, sdk_cpu_share_of_profiler <= 0.10.
Last line: one JSON object: sdk_overhead_ratio, profiler_overhead_ratio, ddp_comm_hook_ratio,
aa_ratio, plain_step_ms and sdk_overhead_ratio_90 (its interval) for the headline workload, the
same with a `_<name>` suffix for the others (sdk_overhead_ratio_40ms, ..._40ms_90), hook_cost_us,
sdk_step_cpu_us, profiler_step_cpu_us, sdk_cpu_share_of_profiler (and their intervals, `_90`),
hook_floor_step_cpu_us, sdk_beyond_floor_cpu_us, sdk_beyond_floor_share_of_profiler (and
their intervals), cpu_aa_us, sdk_other_threads_cpu_us, sdk_background_cpu_us,
profiler_other_threads_cpu_us, profiler_stop_cpu_us, sdk_all_threads_cpu_us,
profiler_all_threads_cpu_us, sdk_all_threads_share_of_profiler, sdk_thread_pct, world and
rounds.
--rounds 0 gives the CPU figures only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import vigil.agent
from vigil.agent import ddp_hook, patching, stacks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_report  # bench/overhead_report.py, beside this script
from overhead_report import CPU_KINDS, MODES

# Two models built alike differ in training-thread CPU per step by hundreds of us for as long
# as they live (where their memory lies): one set's median per model, over its 25 cycles,
# spread by 0.5-0.8 ms (standard deviation) across 48 sets, and in that run the models built
# first and second, bare or the SDK's, cost ~200 us a step more than those built later (a
# trend only at that spread). So the in-place measurement builds a fresh set of models every
# this many cycles, in a new shuffled order each time, so that this bias varies across the run
# and its medians average it, and its intervals resample whole sets (overhead_report.py). With
# the order fixed (the bare pair first, the SDK's model third) and 100 cycles a set, the bare
# pair's A/A (B less A) read -19 to -96 us in each of three runs.
REBUILD_CYCLES = 25
DEFAULT_WORKLOADS = ("250ms=256x128x10", "40ms=256x32x4")
# Run lengths: (full, --quick); an explicit option wins over either.
PRESETS = {
    "rounds": (30, 2),
    "steps": (4, 4),
    # 1,200: at 300 the share's 90 % interval spanned 0.03-0.13, either side of its 0.10 target
    # (a cycle's steps vary by ~1 ms of CPU; the SDK costs a few hundred us); 1,200 cycles
    # (about 4 minutes) narrow it to about +-0.025.
    "cpu_cycles": (1200, 30),
    "sampled_steps": (300, 40),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    hidden: int
    seq_len: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> Workload:
        """NAME=HIDDENxSEQxBATCH, e.g. 250ms=256x128x10."""
        name, _, shape = text.partition("=")
        try:
            hidden, seq_len, batch = (int(v) for v in shape.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not NAME=HIDDENxSEQxBATCH: {text!r}") from None
        if not name.replace("_", "").isalnum():
            raise argparse.ArgumentTypeError(f"a workload name is letters, digits, _: {name!r}")
        return cls(name, hidden, seq_len, batch)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def __str__(self) -> str:
        return f"{self.name} (hidden {self.hidden}, seq-len {self.seq_len}, batch {self.batch})"


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


def _input(w: Workload) -> torch.Tensor:
    return torch.randn(w.batch, w.seq_len, w.hidden)


class _Handle:
    def set_loss(self, loss: Any) -> None:
        pass


@contextlib.contextmanager
def _no_sdk_step(step: int, *, tokens: int) -> Iterator[_Handle]:
    yield _Handle()


def _train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, s: Any
) -> None:
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    s.set_loss(loss)


def _block(
    mode: str,
    w: Workload,
    args: argparse.Namespace,
    tmp: Path,
    pages: Path,
    *,
    steps: int | None = None,
    sampler: _Sampler | None = None,
) -> tuple[list[float], list[float]]:
    """(wall seconds, training-thread CPU seconds) of each measured step; `sampler` runs
    during the measured steps only (not set-up, the first step or shut-down)."""
    steps = steps or args.steps
    model = torch.nn.parallel.DistributedDataParallel(_model(w.hidden, args.layers))
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
    x = _input(w)
    times, cpu = [], []
    step = vigil.agent.step if mode == "sdk" else _no_sdk_step
    for i in range(steps + 1):
        if i == 1 and sampler is not None:
            sampler.start()
        start, start_cpu = time.perf_counter(), time.thread_time()
        with step(i, tokens=w.tokens) as s:
            _train_step(model, opt, x, s)
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
            if ours[-1].partition(" (")[0] in ddp_hook.DDP_BUCKET_WORK:
                bucket_work += int(count)
            else:
                sdk += int(count)
        if not total:
            raise RuntimeError("py-spy sampled no training thread")
        return 100.0 * sdk / total, 100.0 * bucket_work / total, total


def _sdk_thread_pct(
    w: Workload, args: argparse.Namespace, tmp: Path, pages: Path, rank: int
) -> float | None:
    """Rank 0's training-thread wall time inside the SDK's code, sampled (py-spy) while all
    ranks train with the SDK: machine noise stretches a step's samples in and out of the SDK
    alike, so this resolves far below the step-time ratios' noise. The DDP comm hook's division
    and all-reduce start are counted apart: DDP does them with or without a hook. Indirect
    costs (caches, the SDK's background thread) are not in it."""
    sampler = _Sampler(tmp / "sdk.spy") if rank == 0 else None
    try:
        _block("sdk", w, args, tmp, pages, steps=args.sampled_steps, sampler=sampler)
        if sampler is None:
            return None
        sdk, bucket_work, samples = sampler.sdk_shares(os.path.dirname(vigil.agent.__file__))
    except RuntimeError as exc:  # py-spy missing, or not allowed to read this process
        print(f"sampling the training thread failed: {exc}")
        return None
    print(
        f"sampled {samples} training-thread samples over {args.sampled_steps} SDK steps of "
        f"{w.name}: {sdk:.2f} % in the SDK's code, {bucket_work:.2f} % dividing DDP buckets and "
        "starting their all-reduces (DDP's own work, with or without a hook)"
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
        patching.uninstall()
        plain.append(batch())
        patching.install(recorder)
        wrapped.append(batch())
    vigil.agent.shutdown()
    # The fastest batch of each kind is the one least disturbed by other processes.
    return max(0.0, min(wrapped) - min(plain)) * 1e6


def _thread_clock(threads: list[threading.Thread]) -> Callable[[], float]:
    """CPU seconds the given (live) Python threads have used, summed."""
    clocks = []
    for thread in threads:
        if thread.ident is not None:
            with contextlib.suppress(OSError):
                clocks.append(time.pthread_getcpuclockid(thread.ident))

    def read() -> float:
        total = 0.0
        for clock in clocks:
            with contextlib.suppress(OSError):  # a thread that has ended
                total += time.clock_gettime(clock)
        return total

    return read


def _step_cpu(
    w: Workload, args: argparse.Namespace, tmp: Path, pages: Path, solo: Any
) -> dict[str, Any]:
    """Training-thread CPU per step of each of CPU_KINDS, in place, on rank 0 alone (a
    one-member group: no peer to wait for, and the other ranks idle meanwhile), in cycles of
    one step of each kind in a shuffled order. Returns per kind the measured steps' training-
    thread CPU and their CPU on other threads except the SDK's own (all lists of seconds, one
    per cycle), each cycle's set of models (`sets`: what the intervals resample), the
    profiler's stop per profiled step, and the SDK threads' CPU per SDK step."""

    build_order = random.Random(1).shuffle
    sets: list[int] = []  # per measured cycle: the set of models it ran (0, 1, ...)

    def build() -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        models = {}
        kinds = list(CPU_KINDS)
        build_order(kinds)  # where each kind's memory lies: a new order each set
        for kind in kinds:
            ddp = torch.nn.parallel.DistributedDataParallel(
                _model(w.hidden, args.layers), process_group=solo
            )
            models[kind] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4))
        models["ddp_hook"][0].register_comm_hook(solo, default_hooks.allreduce_hook)
        vigil.agent.watch(*models["sdk"])
        return models

    before = set(threading.enumerate())
    vigil.agent.init(job="stepcost", output_dir=tmp / "out", progress_dir=pages, peak_flops=1e11)
    sdk_threads = _thread_clock([t for t in threading.enumerate() if t not in before])
    models = build()
    x = _input(w)
    order = list(CPU_KINDS)
    shuffle = random.Random(0).shuffle
    own: dict[str, list[float]] = {kind: [] for kind in CPU_KINDS}
    other: dict[str, list[float]] = {kind: [] for kind in CPU_KINDS}
    stops: list[float] = []
    sdk_start = sdk_threads()
    i = -1
    while len(own["sdk"]) < args.cpu_cycles:
        i += 1
        # A fresh set of models every REBUILD_CYCLES cycles; each set's first cycle builds DDP
        # buckets (the very first also counts the SDK's model's FLOPs) and is not measured.
        first = i % (REBUILD_CYCLES + 1) == 0
        if first and i:
            models = build()
        shuffle(order)
        for kind in order:
            model, opt = models[kind]
            profiler = None
            if kind == "profiler":
                profiler = torch.profiler.profile()  # default activities: CPU on this machine
                profiler.start()
            t0, p0, s0 = time.thread_time(), time.process_time(), sdk_threads()
            with (
                vigil.agent.step(i, tokens=w.tokens)
                if kind == "sdk"
                else _no_sdk_step(i, tokens=0) as s
            ):
                _train_step(model, opt, x, s)
            t1, p1, s1 = time.thread_time(), time.process_time(), sdk_threads()
            if profiler is not None:
                profiler.stop()
                stops.append(time.thread_time() - t1)
            if not first:
                own[kind].append(t1 - t0)
                other[kind].append((p1 - p0) - (t1 - t0) - (s1 - s0))
        if not first:
            sets.append(i // (REBUILD_CYCLES + 1))
    sdk_total = sdk_threads() - sdk_start
    vigil.agent.shutdown()
    return {
        "own": own,
        "other": other,
        "sets": sets,
        "stop_s": statistics.median(stops[1:]),
        "sdk_threads_s": sdk_total / (i + 1),
    }


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    tmp = Path(tempfile.mkdtemp(prefix=f"vigil-bench-{rank}-"))
    shm = Path("/dev/shm")
    pages = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp / "pages"
    workloads: list[Workload] = args.workload
    cpu_workload = next(w for w in workloads if w.name == args.cpu_workload)
    blocks = [(w, mode) for w in workloads for mode in MODES]
    times: dict[tuple[str, str], list[float]] = {(w.name, mode): [] for w, mode in blocks}
    cpu: dict[tuple[str, str], list[float]] = {(w.name, mode): [] for w, mode in blocks}
    rounds: list[dict[tuple[str, str], float]] = []
    started = time.monotonic()
    for r in range(args.rounds):
        order = blocks[:]
        random.Random(r).shuffle(order)  # the same order on every rank
        medians: dict[tuple[str, str], float] = {}
        for w, mode in order:
            block, block_cpu = _block(mode, w, args, tmp, pages)
            times[w.name, mode] += block
            cpu[w.name, mode] += block_cpu
            medians[w.name, mode] = statistics.median(block)
        rounds.append(medians)
        if rank == 0 and (r == 0 or (r + 1) % 5 == 0):
            print(
                f"round {r + 1}/{args.rounds} done, {time.monotonic() - started:.0f} s", flush=True
            )
    sdk_pct = None
    if args.sampled_steps:
        sdk_pct = _sdk_thread_pct(cpu_workload, args, tmp, pages, rank)
    # Rank 0 alone measures hook and step costs while the others wait: no contention by them.
    solo = dist.new_group([rank], use_local_synchronization=True)
    hook_us, step_cpu = 0.0, None
    if rank == 0:
        hook_us = _hook_cost_us(tmp, pages, solo)
        step_cpu = _step_cpu(cpu_workload, args, tmp, pages, solo)
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(pages, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        assert step_cpu is not None
        print(f"measured in {time.monotonic() - started:.0f} s")
        overhead_report.report(
            args, times, cpu, rounds, hook_us, step_cpu, cpu_workload, sdk_pct, world
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--workload",
        type=Workload.parse,
        action="append",
        help="NAME=HIDDENxSEQxBATCH, repeated; the first is the headline "
        f"(default: {' '.join(DEFAULT_WORKLOADS)})",
    )
    parser.add_argument(
        "--cpu-workload", help="the workload of the in-place CPU figures (default: the last)"
    )
    parser.add_argument("--layers", type=int, default=4)
    # Many short interleaved blocks: a shared machine's load drifts over seconds, and short
    # blocks spread that drift evenly over the modes and workloads.
    parser.add_argument(
        "--rounds", type=int, help="rounds of blocks (30; --quick 2; 0: the CPU figures only)"
    )
    parser.add_argument("--steps", type=int, help="measured steps per block (4)")
    parser.add_argument(
        "--cpu-cycles", type=int, help="cycles of the in-place CPU measurement (1200; --quick 30)"
    )
    parser.add_argument(
        "--sampled-steps",
        type=int,
        help="SDK steps sampled with py-spy for sdk_thread_pct (300; --quick 40; 0: skip)",
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, (full, quick) in PRESETS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.workload = args.workload or [Workload.parse(w) for w in DEFAULT_WORKLOADS]
    names = [w.name for w in args.workload]
    if len(set(names)) != len(names):
        parser.error(f"workload names repeat: {names}")
    args.cpu_workload = args.cpu_workload or names[-1]
    if args.cpu_workload not in names:
        parser.error(f"--cpu-workload {args.cpu_workload!r} is none of {names}")
    if args.rounds < 0 or args.steps < 1:
        parser.error("--rounds must be at least 0 and --steps at least 1")
    if args.cpu_cycles < 2:
        parser.error("--cpu-cycles must be at least 2")
    if args.rank is not None:
        run_rank(args.rank, args.world, args.port, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, __file__, *sys.argv[1:], "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("KINETO_LOG_LEVEL", "99")  # no profiler start/stop lines on stderr
    quiet = subprocess.DEVNULL
    procs = [
        subprocess.Popen([*base, "--rank", str(r)], env=env, stdout=None if r == 0 else quiet)
        for r in range(args.world)
    ]
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise SystemExit(f"ranks failed: {codes}")


if __name__ == "__main__":
    main()
