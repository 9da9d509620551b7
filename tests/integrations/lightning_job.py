"""A user's Lightning job: a tiny GPT-style decoder on synthetic padded token batches, trained by
a real `lightning.pytorch.Trainer` on CPU, with vigil added by one line (`VigilCallback`).

Used by tests/integrations/test_lightning.py and by bench/integrations.py. Command line:

    python tests/integrations/lightning_job.py --out DIR [--steps N] [--no-vigil]
        [--strategy ddp|fsdp2|fsdp|fsdp-cpu] [--accelerator cpu|cuda] [--accumulate K]
        [--batch B] [--nproc N] [--job NAME] [--seed S]
        [--slow-rank R --slow-s SECONDS --slow-from STEP] [--request-checkpoint-at STEP]
        [--collector URL] [--progress-dir DIR] [--also-jsonl] [--cases CASES.json]

- Ranks: under a torchrun-like launcher (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
  MASTER_PORT set) it is one of WORLD_SIZE ranks; otherwise Lightning's own launcher starts
  `--nproc` (default 2) processes running this script. Backend gloo, `OMP_NUM_THREADS` or one
  intra-op thread per rank (nccl with `--accelerator cuda`).
- `--strategy`: ddp (DDPStrategy), fsdp2 (ModelParallelStrategy with FSDP2 `fully_shard` of
  each block and the root in `configure_model`: Lightning's FSDP that runs on CPU), fsdp
  (FSDPStrategy, FSDP1: CUDA only) or fsdp-cpu (FSDPStrategy past Lightning's CPU refusal, to
  show where torch stops it: `FSDP needs a non-CPU accelerator device`).
- `--steps N`: optimizer steps (`max_steps`), each of `--accumulate K` micro-batches (default 1)
  of `--batch B` sequences per rank (default 8: ~20 ms steps on a free CPU core).
- `--no-vigil`: the identical training without the callback (vigil is not imported at all).
- `--out DIR`: `DIR/step_times.rank<R>.json` is the list of per-optimizer-step wall seconds (each
  from the previous step's end, the first from the fit's start) measured by a plain Callback of
  this job's own, independent of vigil (`step_cpu.rank<R>.json`: the process's CPU seconds,
  all its threads, over each); `DIR/job.rank<R>.json` holds what the job itself
  counted per optimizer step (global step, tokens = attention-mask sum, loss), the
  checkpoints vigil saved and the CPU seconds of the threads the fit started
  (`new_threads_cpu`: vigil's, and in a process's first fit the process group's), read at its
  last step; vigil's files go to `DIR/<job>/rank-NNNNN.jsonl` without a
  collector (with `--collector URL`, also there when `--also-jsonl`; `$VIGIL_OUTPUT_DIR`, when
  set, instead of DIR); Lightning's checkpoints under `DIR/checkpoints/`.
- `--job` (default `$VIGIL_JOB`, else lightning-job) and `--progress-dir` (default
  `$VIGIL_PROGRESS_DIR`, else /dev/shm/vigil) as the SDK takes them.
- `--slow-rank R --slow-s S --slow-from STEP`: rank R sleeps S seconds in every `training_step`
  from global step STEP on (a straggler).
- `--request-checkpoint-at STEP`: once global step STEP is reached, rank 0 runs
  `vigil agent --request checkpoint --job NAME --progress-dir DIR`, as an operator would.
- `--cases CASES.json` (under a launcher only): several fits in turn in one process group, a
  JSON list of `{"job": NAME, "steps": N, "vigil": true|false, "threads_from": S}` (the other
  options as given; `threads_from`: also read the started threads' CPU at step S's end),
  each a fresh Trainer and a fresh model with the same seed (so the same weights and data), with
  its own SDK session when `vigil` (init at setup, shutdown at teardown: its records in
  `DIR/NAME/rank-NNNNN.jsonl`, or `$VIGIL_OUTPUT_DIR/NAME/`) and no callback of vigil's at all
  when not; each fit's own files go to `DIR/NAME/` (bench/integrations.py interleaves fits with
  and without vigil this way).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 2, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)
        )

    def forward(self, x: torch.Tensor, causal: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, key_padding_mask=pad, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(pl.LightningModule):
    """Token and position embeddings, LAYERS pre-norm blocks, an untied output head."""

    def __init__(self, *, slow_rank: int, slow_s: float, slow_from: int, lr: float = 3e-3):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.slow_rank, self.slow_s, self.slow_from, self.lr = slow_rank, slow_s, slow_from, lr
        self.step_tokens = 0  # the job's own count, per optimizer step (read by StepLog)
        self.step_losses: list[float] = []

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(diagonal=1)
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        pad = mask == 0
        for block in self.blocks:
            x = block(x, causal, pad)
        return self.head(self.norm(x))  # type: ignore[no-any-return]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.slow_rank and self.global_step >= self.slow_from:
            time.sleep(self.slow_s)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self(ids, mask)
        target_mask = mask[:, 1:].float()
        losses = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (losses * target_mask.reshape(-1)).sum() / target_mask.sum()
        self.step_tokens += int(mask.sum())
        self.step_losses.append(float(loss.detach()))
        return loss

    def configure_model(self) -> None:
        """FSDP2 under ModelParallelStrategy (`--strategy fsdp2`): each block, then the root."""
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class PaddedTokens(Dataset[dict[str, torch.Tensor]]):
    """Sample i: SEQ token ids and a mask of 1s for its first SEQ/2..SEQ positions (the rest
    padding), a pure function of (seed, i)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
        mask = (torch.arange(SEQ) < length).long()
        return {"input_ids": ids * mask, "attention_mask": mask}


def thread_ids() -> set[int]:
    """Native ids of this process's threads (empty where /proc is not there)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def new_threads_cpu(before: set[int]) -> float:
    """CPU seconds of this process's threads started since `before` was taken (Linux's
    per-thread run time, /proc/self/task/<id>/schedstat)."""
    total = 0
    for tid in thread_ids() - before:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return total / 1e9


class StepLog(pl.Callback):
    """The job's own record, independent of vigil: per optimizer step its wall time, tokens and
    loss; rank 0 also sends the operator's checkpoint request when asked to."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.times: list[float] = []
        self.cpu: list[float] = []  # the process's CPU seconds (all threads) over each step
        self.steps: list[dict[str, Any]] = []
        self.last = self.last_cpu = 0.0
        self.seen = 0
        self.threads = thread_ids()  # those running before the fit (the log is made first)
        self.threads_cpu = 0.0  # CPU of the threads the fit started, read at its last step
        self.threads_cpu_from = 0.0  # ... and at the end of step `args.threads_from` (0: none)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last, self.last_cpu = time.perf_counter(), time.process_time()
        self.seen = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.seen:
            return  # a micro-batch that did not step
        now, cpu = time.perf_counter(), time.process_time()
        self.times.append(now - self.last)
        self.cpu.append(cpu - self.last_cpu)
        self.last, self.last_cpu, self.seen = now, cpu, trainer.global_step
        losses = module.step_losses
        self.steps.append(
            {
                "global_step": trainer.global_step - 1,  # the value training_step saw
                "tokens": module.step_tokens,
                "loss": sum(losses) / len(losses),
            }
        )
        module.step_tokens, module.step_losses = 0, []
        if trainer.global_step == self.args.threads_from:
            self.threads_cpu_from = new_threads_cpu(self.threads)
        if trainer.global_step >= trainer.max_steps:  # before the callbacks' on_train_end
            self.threads_cpu = new_threads_cpu(self.threads)
        at = self.args.request_checkpoint_at
        if at is not None and trainer.global_step == at and trainer.global_rank == 0:
            request = [sys.executable, "-m", "vigil", "agent", "--request", "checkpoint"]
            request += ["--job", self.args.job]
            pages = self.args.progress_dir or os.environ.get("VIGIL_PROGRESS_DIR")
            request += ["--progress-dir", pages] if pages else []
            subprocess.run(request, check=True, timeout=60, capture_output=True)


def _strategy(name: str, backend: str) -> Any:
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=backend)
    if name in ("fsdp", "fsdp-cpu"):
        from lightning.pytorch.strategies import FSDPStrategy

        if name == "fsdp":  # as users write it: Lightning accepts it on CUDA only
            return FSDPStrategy(process_group_backend=backend, state_dict_type="full")

        class CpuFSDPStrategy(FSDPStrategy):
            """FSDPStrategy, unchanged: Lightning's accelerator connector refuses
            `type(strategy) is FSDPStrategy` without a CUDA accelerator (an exact-type check,
            lightning/pytorch/trainer/connectors/accelerator_connector.py,
            `_check_strategy_and_fallback`), not FSDP itself, which runs on gloo."""

        return CpuFSDPStrategy(process_group_backend=backend, state_dict_type="full")
    if name == "fsdp2":
        return ModelParallelStrategy(
            data_parallel_size=int(os.environ.get("WORLD_SIZE", "2")),
            tensor_parallel_size=1,
            process_group_backend=backend,
        )
    raise SystemExit(f"unknown strategy {name!r} (ddp or fsdp)")


def _callbacks(args: argparse.Namespace, log: StepLog) -> list[pl.Callback]:
    if args.no_vigil:
        return [log]
    from vigil import schema
    from vigil.integrations.lightning import VigilCallback

    options: dict[str, Any] = {}  # what is not given comes from the environment (VIGIL_*)
    if args.progress_dir:
        options["progress_dir"] = args.progress_dir
    if not os.environ.get("VIGIL_OUTPUT_DIR"):
        options["output_dir"] = args.vigil_out
    if args.collector:
        options.update(collector=args.collector, also_jsonl=args.also_jsonl)
    else:
        options["collector"] = None
    shape = schema.ModelShape(params=0, layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ)
    vigil_cb = VigilCallback(job=args.job, model_shape=shape, peak_flops=1e11, **options)
    return [log, vigil_cb]


def trainer_options(*, steps: int, accumulate: int, root: str | Path) -> dict[str, Any]:
    """The `pl.Trainer` options of this job (and of the in-process tests): no logger, progress
    bar, model summary, validation or automatic checkpointing, only the training vigil sees."""
    return {
        "max_steps": steps,
        "accumulate_grad_batches": accumulate,
        "default_root_dir": root,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
    }


def fit(args: argparse.Namespace, devices: int) -> None:
    """One fit of a fresh model (seeded: every fit starts from the same weights and data);
    writes step_times.rank<R>.json and job.rank<R>.json to `args.out`."""
    pl.seed_everything(args.seed, verbose=False)
    module = TinyGPT(slow_rank=args.slow_rank, slow_s=args.slow_s, slow_from=args.slow_from)
    samples = args.steps * args.accumulate * args.batch * devices
    loader = DataLoader(PaddedTokens(samples, args.seed), batch_size=args.batch)
    log = StepLog(args)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=_strategy(args.strategy, "nccl" if args.accelerator == "cuda" else "gloo"),
        callbacks=_callbacks(args, log),
        **trainer_options(steps=args.steps, accumulate=args.accumulate, root=args.out),
    )
    trainer.fit(module, loader)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = trainer.global_rank
    (out / f"step_times.rank{rank}.json").write_text(json.dumps(log.times))
    (out / f"step_cpu.rank{rank}.json").write_text(json.dumps(log.cpu))
    saved = [str(p) for cb in trainer.callbacks for p in getattr(cb, "checkpoints", [])]
    record = {"steps": log.steps, "global_step": trainer.global_step, "checkpoints": saved}
    record["new_threads_cpu"] = log.threads_cpu
    record["new_threads_cpu_from"] = log.threads_cpu_from
    record["finite"] = all(math.isfinite(s["loss"]) for s in log.steps)
    (out / f"job.rank{rank}.json").write_text(json.dumps(record))


def _cases(args: argparse.Namespace, devices: int) -> None:
    """`--cases`: one fit per case, in turn, in this one process group (see the docstring)."""
    cases = json.loads(Path(args.cases).read_text())
    if not isinstance(cases, list) or not all(isinstance(c, dict) and "job" in c for c in cases):
        raise SystemExit(f"{args.cases}: expected a JSON list of objects with a 'job' name")
    root = Path(args.out)
    for case in cases:
        run = argparse.Namespace(**vars(args))
        run.job, run.out = case["job"], str(root / case["job"])
        run.steps = int(case.get("steps", args.steps))
        run.no_vigil = not case.get("vigil", True)
        run.threads_from = int(case.get("threads_from", 0))
        run.vigil_out = str(root)  # vigil's records: DIR/<job>/rank-NNNNN.jsonl
        fit(run, devices)
        gc.collect()  # the last fit's model and trainer go before the next one is timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-vigil", action="store_true")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--job", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--slow-from", type=int, default=0)
    parser.add_argument("--request-checkpoint-at", type=int, default=None)
    parser.add_argument("--collector", default=None)
    parser.add_argument("--also-jsonl", action="store_true")
    parser.add_argument("--progress-dir", default=None)
    parser.add_argument("--cases", default=None, help="JSON list of fits (see the docstring)")
    args = parser.parse_args()
    args.job = args.job or os.environ.get("VIGIL_JOB") or "lightning-job"
    args.vigil_out = args.out
    args.threads_from = 0  # (a case's option: see --cases)
    if min(args.steps, args.accumulate, args.nproc, args.batch) < 1:
        parser.error("--steps, --accumulate, --batch and --nproc must be >= 1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    external = os.environ.get("WORLD_SIZE")
    devices = int(external) if external else args.nproc
    if args.cases:
        if not external:
            parser.error("--cases runs under a torchrun-like launcher (WORLD_SIZE unset)")
        _cases(args, devices)
    else:
        fit(args, devices)


if __name__ == "__main__":
    main()
