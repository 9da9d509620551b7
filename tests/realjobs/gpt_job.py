"""A user's GPT training script in the style of the popular single-file DDP trainers, launched by
torchrun, with vigil added as the README says (`init`, `watch`, `step`, `span("data")`,
`set_loss`) and nothing else of vigil's.

What it does that `train.py` does not: a small causal transformer (token and position
embeddings, `nn.MultiheadAttention` blocks) compiled with `torch.compile` before DDP wraps it;
gradient accumulation, DDP's all-reduce skipped on all micro-steps but the last
(`require_backward_grad_sync`); gradient clipping; a cosine learning rate; an evaluation every
`EVAL_EVERY` iterations that all-reduces its loss; a checkpoint that only rank 0 saves, and a
loss printed by rank 0 with `.item()`, between iterations.

    torchrun --standalone --nproc-per-node 4 gpt_job.py --cases CASES.json --record DIR [--compile]

Cases run in turn in one process group (the model is compiled once and reloaded with the same
initial weights for each), each a vigil job of its own (JSON list of objects):

    {"job": NAME, "iters": N, "slow": {"rank": R, "factor": F, "where": "forward" | "data"} | null,
     "eval_s": E, "save_s": S, "reshape_at": I}

`slow`: from iteration `FAULT_ITER` on, rank R spends (F - 1) x the iterations' agreed median
time of iterations 2..7 more per iteration, spread over its micro-steps: spinning after each
forward pass, or sleeping in its data loading. vigil writes to `$VIGIL_OUTPUT_DIR/<job>/`; the
`eval_s`: each evaluation goes on (forward passes of the unwrapped model) until E seconds have
passed; `save_s`: rank 0's save then takes S seconds more (slow storage). Both are the loop's
own code, between iterations, on a healthy job. `reshape_at`: from iteration I on, micro-batches
of MICRO_BATCH - 2 (the compiled model recompiles inside that iteration: a new input shape). The
script's own files go to `DIR/<job>/`: rank 0's checkpoints and each rank's `rank<R>.json`, what
the script itself saw (the graphs `torch.compile` made, the checkpoints saved, the iterations).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

import vigil.agent

VOCAB, BLOCK, WIDTH, LAYERS, HEADS = 512, 64, 128, 3, 4
MICRO_BATCH, ACCUMULATE = 8, 4
EVAL_EVERY, CHECKPOINT_EVERY = 20, 25
FAULT_ITER = 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        wide = 4 * WIDTH
        self.mlp = nn.Sequential(nn.Linear(WIDTH, wide), nn.GELU(), nn.Linear(wide, WIDTH))
        self.register_buffer("mask", torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("positions", torch.arange(BLOCK))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(self.positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def get_batch(data: torch.Tensor, size: int = MICRO_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - BLOCK - 1, (size,)).tolist()
    x = torch.stack([data[i : i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1 : i + BLOCK + 1] for i in ix])
    return x, y


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def train(
    case: dict[str, Any], raw: nn.Module, model: nn.Module, data: torch.Tensor, out: Path
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    iters, slow = int(case["iters"]), case.get("slow") or {}
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.1)
    vigil.agent.init(job=case["job"])
    vigil.agent.watch(ddp, opt)
    torch.manual_seed(1000 + rank)
    saved, times, base = [], [], 0.0
    try:
        for it in range(iters):
            started = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = 3e-4 * 0.5 * (1 + math.cos(math.pi * it / iters))
            if it and it % EVAL_EVERY == 0:  # every rank evaluates, rank 0 prints
                ddp.eval()
                began = time.perf_counter()
                with torch.no_grad():
                    val = torch.stack([ddp(*get_batch(data)) for _ in range(4)]).mean()
                    while time.perf_counter() - began < float(case.get("eval_s", 0.0)):
                        model(*get_batch(data))
                ddp.train()
                dist.all_reduce(val)
                if rank == 0:
                    print(f"iter {it}: val loss {val.item() / world:.4f}", flush=True)
            mine = rank == slow.get("rank") and it >= FAULT_ITER
            extra = base * (float(slow.get("factor", 1.0)) - 1.0) if mine else 0.0
            size = MICRO_BATCH - 2 if it >= int(case.get("reshape_at", iters)) else MICRO_BATCH
            with vigil.agent.step(it, tokens=ACCUMULATE * size * BLOCK) as s:
                for micro in range(ACCUMULATE):
                    with vigil.agent.span("data"):
                        x, y = get_batch(data, size)
                        if slow.get("where") == "data" and extra:
                            time.sleep(extra / ACCUMULATE)
                    ddp.require_backward_grad_sync = micro == ACCUMULATE - 1
                    loss = ddp(x, y)
                    if slow.get("where") == "forward" and extra:
                        spin(extra / ACCUMULATE)
                    (loss / ACCUMULATE).backward()
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.set_loss(loss.detach())
            if rank == 0 and it % 10 == 0:
                print(f"iter {it}: loss {loss.item():.4f}", flush=True)
            if rank == 0 and it and it % CHECKPOINT_EVERY == 0:
                path = out / f"ckpt-{it}.pt"
                torch.save({"model": raw.state_dict(), "opt": opt.state_dict(), "iter": it}, path)
                time.sleep(float(case.get("save_s", 0.0)))
                saved.append(path.name)
            times.append(time.perf_counter() - started)
            if it == FAULT_ITER - 3:
                agreed = torch.tensor([statistics.median(times[2:])])
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                base = float(agreed)
    finally:
        vigil.agent.shutdown()
    graphs = int(counters["stats"]["unique_graphs"])
    seen = {"compiled_graphs": graphs, "checkpoints": saved, "iterations": len(times)}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    del ddp, opt  # release the model and optimizer before the process group goes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(1337)
    data = torch.randint(0, VOCAB, (200_000,))
    raw = GPT()
    initial = {k: v.clone() for k, v in raw.state_dict().items()}
    model: nn.Module = torch.compile(raw) if args.compile else raw
    for case in json.loads(Path(args.cases).read_text()):
        raw.load_state_dict(initial)
        out = Path(args.record) / case["job"]
        out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        train(case, raw, model, data, out)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
