"""The training loop: data, forward/backward (with gradient accumulation or a pipeline
schedule), loss agreement, clipping, the optimizer step, checkpoints and control requests.

All ranks agree on what to do after each step through one small all-reduce that carries the
loss and the control flags (checkpoint requested, stop requested), so a request that reaches one
rank through the SDK, or a SIGTERM, turns into the same collective decision everywhere. The
process group must already exist (see `runtime`); this module never creates or destroys it.

Forward, backward and optimizer time come from the SDK's hooks on the watched model and
optimizer (`telemetry.watch`); this loop adds only the "data" and "checkpoint" spans, so no phase
is counted twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from vigil.recovery import snapshots
from vigil.trainer import assembly, checkpoint, data, faults, parallel, pipeline, recipes, telemetry
from vigil.trainer import model as model_lib
from vigil.trainer.exits import ExitCode

log = logging.getLogger(__name__)

MAX_NONFINITE_STEPS = 3  # consecutive skipped steps before giving up: data or LR is broken


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunContext:
    """Where this process sits in the job, and where its outputs go."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    restart_count: int = 0
    job_id: str = "vigil-train"
    metrics_path: Path | None = None  # rank 0 appends one JSON line per step here
    peak_flops: float | None = None  # per device; None when unknown (MFU then reported as 0)


@dataclasses.dataclass(kw_only=True)
class StepStats:
    step: int
    loss: float
    lr: float
    step_s: float
    tokens_per_s: float
    mfu: float
    grad_norm: float = 0.0  # before clipping; 0 when clipping is off or the step was skipped
    skipped: bool = False
    attempt: int = 0  # the restart attempt that ran this step (0 = first start)
    end_s: float = 0.0  # wall-clock time the step finished (Unix seconds)


@dataclasses.dataclass(kw_only=True)
class TrainResult:
    exit_code: ExitCode
    start_step: int  # the step resumed from (0 for a fresh run)
    history: list[StepStats]

    @property
    def losses(self) -> dict[int, float]:
        return {s.step: s.loss for s in self.history}


class _Control:
    """Requests that arrive between steps, from the SDK's control channel or a signal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.checkpoint = False
        self.stop = False

    def request_checkpoint(self, *_: Any) -> None:
        with self._lock:
            self.checkpoint = True

    def request_stop(self, *_: Any) -> None:
        with self._lock:
            self.stop = True

    def take(self) -> tuple[bool, bool]:
        with self._lock:
            flags = (self.checkpoint, self.stop)
            self.checkpoint = False
            return flags


class Trainer:
    """Trains one recipe on one rank of an already-initialized process group (or alone)."""

    def __init__(
        self,
        recipe: recipes.Recipe,
        *,
        ctx: RunContext,
        fault_plan: list[faults.Fault] | None = None,
        tele: telemetry.Telemetry | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.recipe = recipe
        self.ctx = ctx
        self.distributed = dist.is_available() and dist.is_initialized()
        recipe.validate_world(dist.get_world_size() if self.distributed else 1)
        self.tele = tele or telemetry.Telemetry(enabled=False)
        self.clock = clock
        self.control = _Control()
        plan = fault_plan or []
        self.injector = faults.Injector(plan, rank=ctx.rank, attempt=ctx.restart_count)
        self._setup(plan)

    # ----- set-up -------------------------------------------------------------------------
    def _setup(self, plan: list[faults.Fault]) -> None:
        device, recipe = self.ctx.device, self.recipe
        self.mesh = parallel.build_mesh(recipe.parallel, device.type) if self.distributed else None
        self.parts = assembly.assemble(recipe, mesh=self.mesh, device=device)
        dp_rank, dp_size = parallel.dp_coordinates(self.mesh)
        self.data = data.BatchSource(
            seed=recipe.data.seed,
            seq_len=recipe.seq_len,
            vocab=recipe.model.vocab_size,
            global_batch=recipe.global_batch,
            dp_rank=dp_rank,
            dp_size=dp_size,
            device=device,
            text_path=recipe.data.text_path,
        )
        side_group = dist.new_group(backend="gloo") if self.distributed else None
        if any(f.kind is faults.FaultKind.HANG for f in plan) and self.distributed:
            self.injector.set_hang_group(dist.new_group(backend="gloo"))
        self.ckpt = None
        if recipe.checkpoint.directory is not None:
            layout = dataclasses.asdict(recipe.parallel)
            self.ckpt = checkpoint.Checkpointer(
                recipe.checkpoint,
                rank=self.ctx.rank,
                group=side_group,
                extra={"recipe": recipe.name, "layout": {k: str(v) for k, v in layout.items()}},
                on_commit=self._report_commit,
            )
        # Per-step in-memory snapshots under `vigil run` (VIGIL_SNAPSHOT_DIR): the public
        # `vigil.agent.snapshots` machinery, staged here and written in the background.
        self.snaps = snapshots.Snapshots(
            self.parts.owner, self.parts.optimizer, job=self.ctx.job_id
        )
        self._snaps_ready = False
        self.flops_per_token = recipe.model.flops_per_token(recipe.seq_len)
        self.tele.watch(self.parts.owner, self.parts.optimizer)
        self.tele.on_control("checkpoint", self.control.request_checkpoint)

    def _report_commit(self, result: checkpoint.SaveResult) -> None:
        """Tell the collector (a Checkpoint record) that a save committed: the recovery
        controller's "checkpoint now" waits for it."""
        self.tele.checkpoint_committed(
            result.step,
            location=str(result.path),
            num_bytes=result.bytes,
            save_s=result.save_s,
            blocked_s=result.blocked_s,
        )

    def state(self) -> dict[str, Any]:
        """The DCP state dict: model and optimizer under full-model names (any layout)."""
        model_sd, optim_sd = get_state_dict(self.parts.owner, self.parts.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _resume(self) -> int:
        if not self.recipe.checkpoint.resume:
            return 0
        from_snapshot = self._resume_from_snapshot()
        if from_snapshot is not None:
            return from_snapshot
        if self.ckpt is None:
            return 0
        path = self.ckpt.resume_path()
        if path is None:
            log.info("no committed checkpoint in %s: starting at step 0", self.ckpt.root)
            return 0
        state = self.state()
        step = self.ckpt.load(path, state)
        set_state_dict(
            self.parts.owner,
            self.parts.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        log.info("resumed from %s (step %d)", path, step)
        return step

    def _resume_from_snapshot(self) -> int | None:
        """Restore the newest in-memory snapshot when it is newer than every committed
        checkpoint (all ranks restore the same step, or none does); the step it holds."""
        if not self.snaps.enabled:
            return None
        committed = checkpoint.committed_steps(self.ckpt.root) if self.ckpt else []
        first = self.snaps.restore(checkpoint_step=max(committed, default=0))
        if first is None:
            return None
        log.info("resumed from the in-memory snapshot of step %d", first - 1)
        return first - 1

    def _snapshot(self, step: int) -> None:
        # Whether every rank is ready rode on the step's own all-reduce (`_agree`).
        self.snaps.save(step, all_ready=self._snaps_ready)

    # ----- one step -----------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if parallel.needs_autocast(self.recipe, fsdp=self.parts.fsdp):
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient reduction on all but the last accumulation microbatch."""
        module = self.parts.module
        if self.parts.fsdp:
            module.set_requires_gradient_sync(last)  # type: ignore[operator]
        elif self.parts.ddp and not last:
            return module.no_sync()  # type: ignore[operator, no-any-return]
        return contextlib.nullcontext()

    def _forward_backward(self, batch: data.Batch, step: int) -> torch.Tensor | None:
        """Local mean loss of this rank's batch (None on pipeline ranks without the loss)."""
        parts = self.parts
        if parts.schedule is not None and parts.plan is not None:
            with self._autocast():
                loss = pipeline.run_step(parts.schedule, parts.plan, batch.inputs, batch.labels)
            return self.injector.corrupt_loss(step, loss) if loss is not None else None
        accum = self.recipe.accumulation_steps
        total = torch.zeros((), device=self.ctx.device)
        pairs = zip(batch.inputs.chunk(accum), batch.labels.chunk(accum), strict=True)
        for index, (inputs, labels) in enumerate(pairs):
            with self._sync_context(index == accum - 1):
                with self._autocast():
                    loss = model_lib.cross_entropy(parts.module(inputs), labels) / accum
                    loss = self.injector.corrupt_loss(step, loss)
                loss.backward()  # type: ignore[no-untyped-call]
            total += loss.detach()
        return total

    def _agree(self, loss: torch.Tensor | None) -> tuple[float, bool, bool]:
        """World-wide mean loss and control flags, from one all-reduce every rank joins."""
        want_ckpt, want_stop = self.control.take()
        has_loss = loss is not None
        values = [
            float(loss) if loss is not None else 0.0,
            1.0 if has_loss else 0.0,
            float(want_ckpt),
            float(want_stop),
            0.0 if self.snaps.ready else 1.0,  # ranks still writing their last snapshot
        ]
        flags = torch.tensor(values, dtype=torch.float64, device=self.ctx.device)
        if self.distributed:
            dist.all_reduce(flags)
        loss_sum, count, ckpt, stop, busy = flags.tolist()
        self._snaps_ready = busy == 0  # the snapshot after this step: every rank decides alike
        return loss_sum / max(count, 1.0), ckpt > 0, stop > 0

    def _grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.parts.owner.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for group in (
            [g for g in grads if isinstance(g, DTensor)],
            [g for g in grads if not isinstance(g, DTensor)],
        ):
            if not group:
                continue
            norm = torch.nn.utils.get_total_norm(group, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squares += norm.float() ** 2
        if self.mesh is not None and self.recipe.parallel.pp > 1:  # stages hold disjoint layers
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        return squares.sqrt()

    def _optimizer_step(self, step: int, loss: float) -> float | None:
        """Clip and step, returning the gradient norm; None (gradients cleared) when the loss
        is not finite."""
        optimizer = self.parts.optimizer
        if not math.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            return None
        clip = self.recipe.optim.grad_clip
        grad_norm = 0.0
        if clip > 0:
            norm = self._grad_norm()
            params = [p for p in self.parts.owner.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
            grad_norm = float(norm)
        lr = assembly.lr_at(step, self.recipe)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _one_step(self, step: int) -> tuple[StepStats, bool, bool]:
        self.injector.at_step_start(step)
        start = self.clock()
        local_tokens = self.recipe.local_batch * self.recipe.seq_len
        with self.tele.step(step, tokens=local_tokens) as handle:
            with self.tele.span("data"):
                self.injector.on_data(step)
                batch = self.data.batch(step)
            compute_start = self.clock()
            local_loss = self._forward_backward(batch, step)
            self.injector.after_compute(step, self.clock() - compute_start)
            loss, want_ckpt, want_stop = self._agree(local_loss)
            grad_norm = self._optimizer_step(step, loss)
            handle.set_loss(loss)
        step_s = self.clock() - start
        tokens_per_s = self.recipe.tokens_per_step / step_s if step_s > 0 else 0.0
        peak = self.ctx.peak_flops
        world = self.ctx.world_size
        mfu = tokens_per_s * self.flops_per_token / (world * peak) if peak else 0.0
        stats = StepStats(
            step=step,
            loss=loss,
            lr=assembly.lr_at(step, self.recipe),
            step_s=step_s,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            grad_norm=grad_norm or 0.0,
            skipped=grad_norm is None,
            attempt=self.ctx.restart_count,
            end_s=time.time(),
        )
        return stats, want_ckpt, want_stop

    # ----- the run ------------------------------------------------------------------------
    def _save(self, step: int, *, block: bool) -> None:
        if self.ckpt is None:
            log.warning("checkpoint requested at step %d but no checkpoint directory is set", step)
            return
        with self.tele.span("checkpoint"):
            self.ckpt.save(step, self.state(), block=block)

    def _record(self, stats: StepStats) -> None:
        if self.ctx.rank != 0:
            return
        if stats.step % self.recipe.log_every == 0 or stats.skipped:
            log.info(
                "step %d loss %.6f lr %.2e %.3fs %.0f tok/s mfu %.2f%%%s",
                stats.step,
                stats.loss,
                stats.lr,
                stats.step_s,
                stats.tokens_per_s,
                100 * stats.mfu,
                " (skipped: non-finite loss)" if stats.skipped else "",
            )
        if self.ctx.metrics_path is not None:
            with self.ctx.metrics_path.open("a") as fh:
                fh.write(json.dumps(dataclasses.asdict(stats)) + "\n")

    def train(self, *, stop_after: int | None = None) -> TrainResult:
        """Run from the newest committed checkpoint to `recipe.steps` (or `stop_after`)."""
        start = self._resume()
        last = min(self.recipe.steps, stop_after) if stop_after is not None else self.recipe.steps
        history: list[StepStats] = []
        interval = self.recipe.checkpoint.interval_steps
        bad_in_row = 0
        for step in range(start + 1, last + 1):
            stats, want_ckpt, want_stop = self._one_step(step)
            self._snapshot(step)
            history.append(stats)
            self._record(stats)
            bad_in_row = bad_in_row + 1 if stats.skipped else 0
            if bad_in_row >= MAX_NONFINITE_STEPS:
                log.error("loss was non-finite for %d steps in a row: giving up", bad_in_row)
                return TrainResult(
                    exit_code=ExitCode.NONFINITE_LOSS, start_step=start, history=history
                )
            if want_stop:
                self._save(step, block=True)
                log.warning("stopped on request at step %d after a checkpoint", step)
                return TrainResult(exit_code=ExitCode.STOPPED, start_step=start, history=history)
            if want_ckpt or (interval and step % interval == 0 and step < last):
                self._save(step, block=False)
        if self.ckpt is not None and history and self.ckpt.last_saved_step != last:
            self._save(last, block=True)
        return TrainResult(exit_code=ExitCode.OK, start_step=start, history=history)

    def close(self, timeout_s: float = 120.0) -> None:
        """Finish the save in flight, then drop model and optimizer (before the group goes)."""
        if self.ckpt is not None:
            self.ckpt.wait(timeout_s)
        self.snaps.close(timeout_s)
        self.data.close()
        del self.parts
        self.tele.shutdown()


@contextlib.contextmanager
def trainer_session(recipe: recipes.Recipe, **kwargs: Any) -> Iterator[Trainer]:
    trainer = Trainer(recipe, **kwargs)
    try:
        yield trainer
    finally:
        trainer.close()
