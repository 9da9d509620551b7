"""vigil.integrations.megatron on a GPU: Megatron-core's real schedule timed, its groups labelled.

What CPU cannot run (Megatron's schedules allocate CUDA tensors before the first micro-batch):
one process on cuda:0 with NCCL, `initialize_model_parallel()` (every size 1), `label_groups()`,
then 10 steps of `timed(get_forward_backward_func())` (`forward_backward_no_pipelining`) over a
small MLP, 4 micro-batches a step, each step's gradients all-reduced over Megatron's dp group,
inside `vigil.agent.step`. The SDK's JSONL records are read back: each step must have forward and
backward time, the forward time must be about what the same forwards take outside the schedule
(CUDA-synchronised, so launch-time timestamps measure the work), and the dp all-reduce must be
recorded as a `dp:<id>` group. Prints a few lines, then one JSON object (last line):
{"megatron_check_ok", "megatron_schedule", "megatron_labels", "megatron_forward_ms",
"megatron_backward_ms", "megatron_step_ms", "megatron_forward_ratio"}; exit 1 when a check
fails, 3 when megatron-core is not importable (carry it in, see bench/gpu/run.sh).
Usage: python bench/gpu/megatron_check.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HIDDEN, BATCH, MICROBATCHES = 2048, 64, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Mlp(torch.nn.Module):
    def __init__(self, config: Any, model_type: Any) -> None:
        super().__init__()
        self.config, self.model_type = config, model_type
        self.net = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 4 * HIDDEN),
            torch.nn.GELU(),
            torch.nn.Linear(4 * HIDDEN, HIDDEN),
        )

    def set_input_tensor(self, tensor: Any) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _forward_step(data_iterator: Any, model: _Mlp) -> tuple[torch.Tensor, Any]:
    out = model(next(data_iterator))
    torch.cuda.synchronize()  # the forward's work, not its launch, inside the forward span

    def loss_func(o: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = o.float().square().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    try:
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        print(json.dumps({"megatron_check_ok": False, "megatron_error": f"not importable: {exc}"}))
        return 3
    import vigil.agent
    from vigil import codec, schema
    from vigil.integrations import megatron as vigil_megatron

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    parallel_state.initialize_model_parallel()
    out = Path(tempfile.mkdtemp(prefix="vigil-megatron-"))
    vigil.agent.init(job="megatron-gpu", collector=None, output_dir=out, progress_dir=out / "pg")
    labels = vigil_megatron.label_groups()
    # Megatron's schedules read TransformerConfig's fields (e.g. its activation offloading).
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1)
    model = _Mlp(config, ModelType.encoder_or_decoder).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = [torch.randn(BATCH, HIDDEN, device="cuda") for _ in range(MICROBATCHES)]
    forward_backward = vigil_megatron.get_forward_backward_func()
    dp_group = parallel_state.get_data_parallel_group()
    for step in range(args.steps):
        with vigil.agent.step(step, tokens=BATCH * MICROBATCHES):
            forward_backward(
                forward_step_func=_forward_step, data_iterator=iter(data), model=model,
                num_microbatches=MICROBATCHES, seq_length=1, micro_batch_size=BATCH,
            )  # fmt: skip
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
    # The same forwards outside any schedule, for scale.
    alone = []
    for _ in range(5):
        start = time.perf_counter()
        with torch.no_grad():
            for x in data:
                model(x)
            torch.cuda.synchronize()
        alone.append(time.perf_counter() - start)
    vigil.agent.shutdown()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()

    records = [
        codec.decode_json(line)
        for path in out.glob("**/rank-*.jsonl")
        for line in path.read_bytes().splitlines()
    ]
    steps = [r for r in records if isinstance(r, schema.StepRecord)][2:]  # warm-up left out
    groups = {r.group for r in records if isinstance(r, schema.CollectiveAggregate)}
    forward = statistics.median(s.forward_s for s in steps)
    backward = statistics.median(s.backward_s for s in steps)
    ratio = forward / statistics.median(alone)
    ok = (
        len(steps) == args.steps - 2
        and all(s.forward_s > 0 and s.backward_s > 0 for s in steps)
        and any(g.startswith("dp:") for g in groups)
        and 0.5 < ratio < 3.0
    )
    print(f"schedule {forward_backward.__name__}; labels {', '.join(sorted(labels))}")
    print(f"groups recorded: {', '.join(sorted(groups))}")
    print(f"per step: forward {forward * 1e3:.2f} ms (alone {statistics.median(alone) * 1e3:.2f}"
          f" ms), backward {backward * 1e3:.2f} ms")  # fmt: skip
    print(json.dumps({
        "megatron_check_ok": ok,
        "megatron_schedule": forward_backward.__name__,
        "megatron_labels": len(labels),
        "megatron_forward_ms": round(forward * 1e3, 3),
        "megatron_backward_ms": round(backward * 1e3, 3),
        "megatron_step_ms": round(statistics.median(s.step_time_s for s in steps) * 1e3, 3),
        "megatron_forward_ratio": round(ratio, 3),
    }))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
