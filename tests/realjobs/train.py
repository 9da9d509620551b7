"""A user's own PyTorch training job, instrumented only through vigil's public SDK.

Written the way a user writes their loop, not the way vigil's bundled trainer does: the model,
the parallel wrapper and the loop are plain PyTorch; vigil sees it through `init`, `watch`,
`step`, `span` and `shutdown` alone. Faults are injected by the job itself (sleeps, a collective
no peer joins, an abrupt exit), so what vigil reports is compared with what was really done.

One launch runs several cases in turn, each a vigil job of its own (init ... shutdown), so one
process group start serves many cases. Launched like torchrun launches (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment):

    python train.py --wrapper ddp --cases cases.json --out DIR [--collector URL] [--device cuda]

`--device cuda` puts each rank's model and batches on GPU LOCAL_RANK % (GPUs there are), with
NCCL when every rank has a GPU of its own and gloo (which reduces CUDA tensors through the host)
when ranks share one; wrappers ddp, plain and plain_async. There a slow rank is slow on the
device: its delay is a kernel that spins on its stream (`torch.cuda._sleep`), which no CPU clock
of its own sees, except in data loading, which is host work.

Wrappers: ddp (DistributedDataParallel, its all-reduce inside C++), fsdp (FSDP2 fully_shard),
tp (DTensor tensor parallelism), pp (torch.distributed.pipelining, 1F1B), plain (a loop that
all-reduces its gradients itself with dist.all_reduce), plain_async (the same, launching every
gradient's all-reduce asynchronously, then waiting for each), fsdp_tp (tensor parallel within pairs
of ranks, FSDP2 across them: a 2-D mesh). A case is a JSON object:
    {"job": NAME, "steps": N, "fault": {...} | null, "noise": {...} | null, "seed": S}
fault kinds: slow (rank, factor, where = forward | backward | optimizer | data, from_step,
every, ramp; forward: before the forward pass, in a pipeline a slow forward layer), hang (rank,
step, seconds, where = before | collective | data | checkpoint), crash (rank, step).
noise kinds: jitter (share), hiccup (count, factor), cpu_hog (a busy process on every core;
host_rank starts them; shared: in its session, a noisy neighbour that slows that rank).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import vigil.agent

HIDDEN = 256
LAYERS = 4
BATCH = 32
MICROBATCHES = 4  # of the pipeline's 1F1B schedule
WARMUP = 6  # fault-free steps whose median step time sizes every injected delay


class Spinner:
    """Spends a given time where the job computes: the host sleeps on CPU; on CUDA a kernel
    spins on the current stream for that long (`torch.cuda._sleep`, calibrated once)."""

    def __init__(self, device: torch.device) -> None:
        self.cycles_per_s = 0.0
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # warm up
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_s = 20_000_000 / (start.elapsed_time(end) / 1000.0)

    def __call__(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.cycles_per_s:
            torch.cuda._sleep(int(seconds * self.cycles_per_s))
        else:
            time.sleep(seconds)


CPU = torch.device("cpu")
SPIN = Spinner(CPU)  # replaced by a CUDA one under --device cuda


class _SlowBackward(torch.autograd.Function):
    """Identity forward; its backward is slow while `SlowPoint.delay_s` is set (a slow layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, point: SlowPoint) -> torch.Tensor:
        ctx.point = point
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.point.delay_s > 0:
            SPIN(ctx.point.delay_s / ctx.point.calls)
        return grad, None


class SlowPoint(torch.nn.Module):
    """A layer that does nothing unless told to be slow (`delay_s` in backward, `forward_s` in
    forward), spread over the `calls` times it runs per step (a pipeline's microbatches)."""

    def __init__(self) -> None:
        super().__init__()
        self.delay_s = 0.0
        self.forward_s = 0.0
        self.calls = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_s > 0:
            SPIN(self.forward_s / self.calls)
        return _SlowBackward.apply(x, self)  # type: ignore[no-any-return]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.slow = SlowPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = len(self.blocks) // 2
        for i, block in enumerate(self.blocks):
            if i == half:
                x = self.slow(x)
            x = block(x)
        return x


# -- the parallel wrappers --------------------------------------------------------------------
class Job:
    """One wrapper's model, optimizer and train step."""

    def __init__(self, wrapper: str, rank: int, world: int, device: torch.device = CPU) -> None:
        self.wrapper, self.rank, self.world, self.device = wrapper, rank, world, device
        if device.type == "cuda" and wrapper not in ("ddp", "plain", "plain_async"):
            raise SystemExit(f"--device cuda runs wrappers ddp, plain and plain_async: {wrapper!r}")
        torch.manual_seed(0)
        self.schedule: Any = None
        self.stage_module: Any = None
        if wrapper == "pp":
            self._build_pipeline()
        else:
            net = Net().to(device)
            self.slow = net.slow
            if wrapper == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                ids = [device.index] if device.type == "cuda" else None
                self.model: torch.nn.Module = DistributedDataParallel(
                    net, device_ids=ids, bucket_cap_mb=1
                )
            elif wrapper == "fsdp":
                from torch.distributed.fsdp import fully_shard

                for block in net.blocks:
                    fully_shard(block)
                fully_shard(net)
                self.model = net
            elif wrapper == "tp":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
                plan = {}
                for i in range(len(net.blocks)):
                    plan[f"blocks.{i}.up"] = ColwiseParallel()
                    plan[f"blocks.{i}.down"] = RowwiseParallel()
                self.model = parallelize_module(net, mesh, plan)
            elif wrapper == "fsdp_tp":  # 2-D: tensor parallel inside, FSDP2 across (torchtitan)
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
                plan = {}
                for i in range(len(net.blocks)):
                    plan[f"blocks.{i}.up"] = ColwiseParallel()
                    plan[f"blocks.{i}.down"] = RowwiseParallel()
                parallelize_module(net, mesh["tp"], plan)
                for block in net.blocks:
                    fully_shard(block, mesh=mesh["dp"])
                self.model = fully_shard(net, mesh=mesh["dp"])
            elif wrapper in ("plain", "plain_async"):
                self.model = net
            else:
                raise SystemExit(f"unknown wrapper {wrapper!r}")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def _build_pipeline(self) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        torch.manual_seed(0)
        stage = Net(layers=2)  # each rank holds one stage of 2 blocks
        self.slow = stage.slow
        self.stage_module = stage
        self.model = stage
        pipe = PipelineStage(stage, self.rank, self.world, torch.device("cpu"))
        self.schedule = Schedule1F1B(
            pipe, n_microbatches=MICROBATCHES, loss_fn=lambda out, t: (out - t).pow(2).mean()
        )
        stage.slow.calls = MICROBATCHES

    def batch(self, step: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 100_003 + step * 31 + self.rank_for_data())
        return torch.randn(BATCH, HIDDEN, generator=g).to(self.device)

    def rank_for_data(self) -> int:
        # Tensor- and pipeline-parallel ranks see the same batch; data-parallel ones their own.
        if self.wrapper == "fsdp_tp":
            return self.rank // 2  # the data-parallel coordinate
        return 0 if self.wrapper in ("tp", "pp") else self.rank

    def forward_backward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.schedule is not None:
            target = torch.zeros(BATCH, HIDDEN)
            losses: list[torch.Tensor] = []
            if self.rank == 0:
                self.schedule.step(x)
            elif self.rank == self.world - 1:
                self.schedule.step(target=target, losses=losses)
            else:
                self.schedule.step()
            return torch.stack(losses).mean() if losses else None
        loss = self.model(x).pow(2).mean()
        loss.backward()
        if self.wrapper == "plain":
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.world)
        elif self.wrapper == "plain_async":  # every all-reduce in flight, then each waited for
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            works = [dist.all_reduce(g, async_op=True) for g in grads]
            for work, g in zip(works, grads, strict=True):
                work.wait()
                g.div_(self.world)
        return loss

    def close(self) -> None:
        del self.opt, self.model, self.schedule, self.stage_module


# -- faults and noise -------------------------------------------------------------------------
class Case:
    def __init__(self, spec: dict[str, Any], rank: int, world: int) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.fault: dict[str, Any] = spec.get("fault") or {}
        self.noise: dict[str, Any] = spec.get("noise") or {}
        self.rng = random.Random(f"{spec.get('seed', 0)}-{rank}")
        self.base_s = 0.0
        shared = random.Random(f"{spec.get('seed', 0)}-shared")
        steps = int(spec["steps"])
        self.hiccups = {
            (shared.randrange(world), shared.randrange(WARMUP, steps))
            for _ in range(int(self.noise.get("count", 2)))
        }

    def mine(self, kind: str) -> bool:
        return self.fault.get("kind") == kind and int(self.fault.get("rank", -1)) == self.rank

    def slow_delay(self, step: int, where: str) -> float:
        """Extra seconds this rank spends at `where` in `step`."""
        f = self.fault
        if not self.mine("slow") or f.get("where", "forward") != where or self.base_s <= 0:
            return 0.0
        start = int(f.get("from_step", WARMUP + 2))
        if step < start:
            return 0.0
        every = int(f.get("every", 1))
        if (step - start) % every:
            return 0.0
        if f.get("ramp"):
            return self.base_s * float(f["ramp"]) * (step - start + 1)
        return self.base_s * (float(f["factor"]) - 1.0)

    def noise_delay(self, step: int) -> float:
        if self.base_s <= 0 or step < WARMUP:
            return 0.0
        kind = self.noise.get("kind")
        if kind == "jitter":  # ±share around a mean extra of share, independently per rank
            share = float(self.noise.get("share", 0.15))
            return self.base_s * share * (1.0 + self.rng.uniform(-1.0, 1.0))
        if kind == "hiccup" and (self.rank, step) in self.hiccups:
            return self.base_s * (float(self.noise.get("factor", 3.0)) - 1.0)
        return 0.0

    def collective_hang(self, step: int) -> float:
        """Seconds of a hang inside a collective at `step` (every rank takes part in it)."""
        f = self.fault
        if f.get("kind") == "hang" and f.get("where") == "collective" and int(f["step"]) == step:
            return float(f.get("seconds", 10.0))
        return 0.0

    def hang_here(self, step: int, where: str) -> float:
        f = self.fault
        if self.mine("hang") and int(f["step"]) == step and f.get("where", "before") == where:
            return float(f.get("seconds", 10.0))
        return 0.0


def run_case(
    job: Job, case: Case, args: argparse.Namespace, side: Any, spec: dict[str, Any]
) -> None:
    rank = job.rank
    vigil.agent.init(
        job=spec["job"],
        collector=args.collector,
        output_dir=args.out,
        also_jsonl=bool(args.collector),
        progress_dir=args.progress_dir,
    )
    vigil.agent.watch(job.model, job.opt)
    hogs = []
    if case.noise.get("kind") == "cpu_hog" and rank == int(case.noise.get("host_rank", 0)):
        # Background load on the whole node: one busy process bound to each core, each in a
        # session of its own, so every rank competes with it alike. (Left in this rank's
        # session, the kernel's autogroup scheduling makes the hogs share this rank's CPU
        # share: it then really is a straggler, 2.5x slower, and vigil says so.)
        for cpu in sorted(os.sched_getaffinity(0)):
            code = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
            alone = not case.noise.get("shared", False)  # shared: a noisy neighbour of this rank
            hogs.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=alone))
    times: list[float] = []
    try:
        for step in range(int(spec["steps"])):
            if case.mine("crash") and int(case.fault["step"]) == step:
                os._exit(13)
            started = time.monotonic()
            with vigil.agent.step(step, tokens=BATCH) as s:
                with vigil.agent.span("data"):
                    x = job.batch(step, int(spec.get("seed", 0)))
                    delay = case.slow_delay(step, "data") + case.hang_here(step, "data")
                    if delay:
                        time.sleep(delay)
                # Before forward; in a pipeline a slow forward layer instead (a stage that sleeps
                # before its schedule starts only shortens its own bubble).
                slow_forward = case.slow_delay(step, "forward")
                job.slow.forward_s = slow_forward if job.schedule is not None else 0.0
                pause = case.hang_here(step, "before") + case.noise_delay(step)
                if pause:
                    time.sleep(pause)
                if job.schedule is None:
                    SPIN(slow_forward)
                seconds = case.collective_hang(step)
                if seconds:
                    _join_late(side, seconds, rank, case)
                job.slow.delay_s = case.slow_delay(step, "backward")
                loss = job.forward_backward(x)
                job.slow.delay_s = job.slow.forward_s = 0.0
                job.opt.step()
                job.opt.zero_grad()
                SPIN(case.slow_delay(step, "optimizer"))
                if loss is not None:
                    s.set_loss(loss.detach())
            if int(case.fault.get("step", -1)) == step and case.fault.get("where") == "checkpoint":
                with vigil.agent.span("checkpoint"):
                    torch.save(job.model.state_dict(), os.path.join(args.out, f"ckpt-{rank}.pt"))
                    if case.mine("hang"):
                        time.sleep(float(case.fault.get("seconds", 10.0)))
                dist.barrier()
            if step < WARMUP and job.device.type == "cuda":
                torch.cuda.synchronize()  # the warm-up's step times are the device's
            times.append(time.monotonic() - started)
            if step == WARMUP - 1:
                case.base_s = _agreed_median(times, job.device)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        vigil.agent.shutdown()


def _agreed_median(times: list[float], device: torch.device) -> float:
    """The warm-up's median step time, the same on every rank (the largest rank's)."""
    t = torch.tensor([statistics.median(times[1:])], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _join_late(side: Any, seconds: float, rank: int, case: Case) -> None:
    """Hang inside a collective: the culprit enters an all-reduce of the side group that its
    peers join only `seconds` later, from a thread of theirs, through the process group object
    (below the SDK). A hang is bounded so that one launch can run more cases after it."""
    if case.mine("hang"):
        dist.all_reduce(torch.zeros(1), group=side)
        return

    def join() -> None:
        time.sleep(seconds)
        side.allreduce([torch.zeros(1)]).wait()

    threading.Thread(target=join, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wrapper", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--collector", default=None)
    parser.add_argument("--progress-dir", default="/dev/shm/vigil")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device, backend = CPU, "gloo"
    if args.device == "cuda":
        global SPIN
        gpus, world = torch.cuda.device_count(), int(os.environ["WORLD_SIZE"])
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(gpus, 1))
        torch.cuda.set_device(device)
        backend = "nccl" if gpus >= world else "gloo"  # NCCL refuses two ranks on one GPU
        SPIN = Spinner(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    side = dist.new_group(backend="gloo")  # only a hang-inside-a-collective case uses it
    with open(args.cases) as f:
        specs = json.load(f)
    for spec in specs:
        case = Case(spec, rank, world)
        job = Job(args.wrapper, rank, world, device)
        dist.barrier()
        run_case(job, case, args, side, spec)
        job.close()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
