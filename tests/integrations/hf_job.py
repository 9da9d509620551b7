"""A user's Hugging Face Trainer job: a tiny GPT-2 built from a config, with `VigilCallback`.

The model has random weights (no downloads) and trains on a synthetic causal-LM dataset whose
samples have different lengths, padded per batch (so the attention mask's sum is not the batch
size). Launched like torchrun launches (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
in the environment; gloo on CPU) or alone:

    python hf_job.py --out DIR [--steps N] [--no-vigil] [--parallel ddp|fsdp] [--grad-accum K]
                     [--device cpu|cuda] [--cases CASES.json] [--progress-dir P]

One case by default: `--steps` optimizer steps, and each rank writes
`DIR/step_times.rank<R>.json`, the wall seconds of each optimizer step measured by a plain
callback of the job's own, vigil or not, from the previous step's end (the first: from train
begin) to this one's, so everything between two steps counts, other callbacks' hooks and the
data loader included; `--no-vigil` runs the same training without `VigilCallback`. `--cases`
runs several cases in turn in one process group, each a fresh Trainer and model (same seed)
and a vigil job of its own unless `"vigil": false`, which leaves the callback out
(bench/integrations.py interleaves the two this way) (JSON list of objects):

    {"job": NAME, "steps": N, "grad_accum": K, "slow": {"rank": R, "factor": F} | null,
     "vigil": true, "parallel": "ddp" | "fsdp", "no_vigil_rank": R | null, "threads_from": S}

`slow`: rank R sleeps inside each step from step 9 on, (F - 1) x its median step time of steps
3..8 (a straggler). `no_vigil_rank`: vigil cannot start on rank R (its progress folder
cannot be made), the others run it. For every case each rank writes
`DIR/<job>/job.rank<R>.json`: what the job itself counted per optimizer step (Trainer's
global_step, the step's wall seconds from on_step_begin to on_step_end and from the previous
step's end, the process's CPU seconds over the latter, the non-padding tokens and all
positions of its micro-batches, the loss Trainer's training_step returned summed over them),
the checkpoint folders Trainer wrote, whether accelerate really sharded the model, and the CPU
seconds of the threads the case started (`new_threads_cpu`: vigil's, and in the first case the
process group's), read at its last step end (and `new_threads_cpu_from`, at the end of step
`threads_from`, when given), and how many threads the process runs after it, once the
threads the case started have ended (`threads_after`, waiting up to 3 s for them).
vigil's files go to `DIR/vigil/<job>/rank-NNNNN.jsonl` (no collector), Trainer's to
`DIR/<job>/trainer/`. A "checkpoint" request (`vigil agent --request checkpoint --job NAME`,
or the collector's control API through a node agent) makes Trainer save a `checkpoint-N`
folder there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from vigil.env import EnvVar
from vigil.integrations.hf import VigilCallback

VOCAB = 256
MIN_LEN, MAX_LEN = 24, 64
BATCH = 4
WARMUP = range(3, 9)  # steps whose median sizes the straggler's sleep
SLOW_FROM = 9


class Samples(torch.utils.data.Dataset[dict[str, list[int]]]):
    """Random token sequences of random lengths (seeded: every run sees the same data)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.rows = [
            [rng.randrange(VOCAB) for _ in range(rng.randint(MIN_LEN, MAX_LEN))]
            for _ in range(count)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[i]}


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; padding is masked out and ignored by the loss."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, : len(row["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class CountingTrainer(transformers.Trainer):
    """Counts what each micro-batch really held, the way a user would check: a Trainer subclass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_tokens = 0
        self.step_positions = 0  # padding included
        self.step_loss = 0.0

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        self.step_tokens += int(inputs["attention_mask"].sum())
        self.step_positions += inputs["input_ids"].numel()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_loss += float(loss)
        return loss


def thread_ids() -> set[int]:
    """Native ids of this process's threads (empty where /proc is not there)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def threads_once_ended(started_before: set[int], wait_s: float = 3.0) -> int:
    """How many threads the process runs once those started since `started_before` have ended,
    waiting up to `wait_s` for them: a joined thread is reaped by the OS a moment after its
    join returns, and a gloo group's worker threads end as its last reference goes. Threads
    still running after `wait_s` (a process group the case made and kept) are counted."""
    gc.collect()  # a group only a reference cycle still holds is garbage, not kept
    deadline = time.monotonic() + wait_s
    while thread_ids() - started_before and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(thread_ids())


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


class JobLog(transformers.TrainerCallback):
    """The job's own record of each optimizer step (wall time, global_step, tokens, loss), and
    the straggler and the operator's checkpoint request it injects."""

    def __init__(self, case: dict[str, Any], rank: int) -> None:
        self.case, self.rank = case, rank
        self.trainer: CountingTrainer | None = None
        self.steps: list[dict[str, Any]] = []
        self.started = 0.0
        self.ended = self.cpu = 0.0
        self.sleep_s = 0.0
        self.threads = thread_ids()  # those running before the case (see run_case)
        self.threads_cpu = 0.0  # CPU of the threads the case started, read at its last step
        self.threads_cpu_from = 0.0  # ... and at the end of step `threads_from` (0: none)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ended, self.cpu = time.perf_counter(), time.process_time()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = time.perf_counter()
        slow = self.case.get("slow")
        step = state.global_step + 1
        if slow and slow["rank"] == self.rank and step >= SLOW_FROM:
            if not self.sleep_s:
                median = statistics.median(self.steps[i - 1]["seconds"] for i in WARMUP)
                self.sleep_s = (slow["factor"] - 1.0) * median
            time.sleep(self.sleep_s)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        seconds, interval, cpu_s = now - self.started, now - self.ended, cpu - self.cpu
        self.ended, self.cpu = now, cpu
        trainer = self.trainer
        assert trainer is not None
        self.steps.append(
            {
                "step": state.global_step,
                "seconds": seconds,
                "interval": interval,
                "cpu": cpu_s,  # the process's CPU seconds (all its threads) over the interval
                "tokens": trainer.step_tokens,
                "positions": trainer.step_positions,
                "loss": trainer.step_loss,
            }
        )
        trainer.step_tokens, trainer.step_positions, trainer.step_loss = 0, 0, 0.0
        if state.global_step == self.case.get("threads_from", 0):
            self.threads_cpu_from = new_threads_cpu(self.threads)
        if state.global_step >= self.case["steps"]:  # before the callbacks' on_train_end
            self.threads_cpu = new_threads_cpu(self.threads)


def training_args(case: dict[str, Any], out: Path, ns: argparse.Namespace) -> Any:
    fsdp: dict[str, Any] = {}
    cpu = ns.device == "cpu"
    if case.get("parallel", ns.parallel) == "fsdp":
        fsdp = {  # FSDP2 (fully_shard), each GPT-2 block a unit of its own
            "fsdp": True,
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        }
    return transformers.TrainingArguments(
        output_dir=str(out / case["job"] / "trainer"),
        run_name=case["job"],
        max_steps=case["steps"],
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=case.get("grad_accum", 1),
        learning_rate=1e-3,
        save_strategy="no",  # only a "checkpoint" request saves
        logging_steps=10,
        report_to="none",
        disable_tqdm=True,
        use_cpu=cpu,
        ddp_backend=("gloo" if cpu else "nccl")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1
        else None,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        seed=0,
        **fsdp,
    )


def model(layers: int, hidden: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=hidden, n_layer=layers, n_head=4
    )
    return transformers.GPT2LMHeadModel(config)


def run_case(case: dict[str, Any], ns: argparse.Namespace, rank: int) -> list[dict[str, Any]]:
    out: Path = ns.out
    log = JobLog(case, rank)
    callbacks: list[Any] = [log]
    if case.get("vigil", True):
        broken = {}
        if case.get("no_vigil_rank") == rank:  # vigil cannot start on this rank
            blocked = out / f"blocked.rank{rank}"
            blocked.write_text("a file where the progress folder should go")
            broken = {"progress_dir": str(blocked / "pages")}
        # One case alone (the benchmark's) reports as $VIGIL_JOB says, into $VIGIL_OUTPUT_DIR,
        # as a user's script would; named cases each as a job of their own under DIR/vigil/.
        named = ns.cases is not None or not os.environ.get(EnvVar.JOB)
        output_dir = os.environ.get(EnvVar.OUTPUT_DIR) if ns.cases is None else None
        callbacks.insert(
            0,
            VigilCallback(
                job=case["job"] if named else None,
                output_dir=output_dir or str(out / "vigil"),
                **broken,
            ),
        )
    args = training_args(case, out, ns)
    steps_needed = case["steps"] * case.get("grad_accum", 1) * BATCH * args.world_size
    trainer = CountingTrainer(
        model=model(ns.layers, ns.hidden),
        args=args,
        train_dataset=Samples(steps_needed + BATCH),
        data_collator=collate,
        callbacks=callbacks,
    )
    log.trainer = trainer
    trainer.train()
    folders = sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*"))
    record = {
        "steps": log.steps,
        "checkpoints": folders,
        "world_size": args.world_size,
        "fsdp": bool(trainer.is_fsdp_enabled),  # whether accelerate really sharded the model
        "wrapper": type(trainer.model_wrapped).__name__,
        "new_threads_cpu": log.threads_cpu,
        "new_threads_cpu_from": log.threads_cpu_from,
        "threads_after": threads_once_ended(log.threads),  # once the case is over
    }
    (out / case["job"]).mkdir(parents=True, exist_ok=True)
    (out / case["job"] / f"job.rank{rank}.json").write_text(json.dumps(record))
    return log.steps


def main() -> int:
    code = _main()
    if torch.distributed.is_initialized():  # a clean exit: every rank done, then gloo ends
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return code


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-vigil", action="store_true", help="train without VigilCallback")
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--cases", type=Path, help="JSON list of cases (see the docstring)")
    parser.add_argument("--progress-dir", help="the progress root vigil's pages live in")
    ns = parser.parse_args()
    if ns.progress_dir:
        os.environ[EnvVar.PROGRESS_DIR] = ns.progress_dir
    rank = int(os.environ.get("RANK", "0"))
    transformers.logging.set_verbosity_error()
    if ns.cases:
        for case in json.loads(ns.cases.read_text()):
            run_case(case, ns, rank)
            gc.collect()  # the last case's Trainer and model go before the next one is timed
        return 0
    job = f"hf-bench-{'plain' if ns.no_vigil else 'vigil'}"
    case = {"job": job, "steps": ns.steps, "grad_accum": ns.grad_accum, "vigil": not ns.no_vigil}
    steps = run_case(case, ns, rank)
    ns.out.mkdir(parents=True, exist_ok=True)
    times = [s["interval"] for s in steps]
    (ns.out / f"step_times.rank{rank}.json").write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
