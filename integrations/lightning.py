"""vigil for Lightning: `VigilCallback`, a `lightning.pytorch.Callback` driving the public SDK.

    import lightning.pytorch as pl
    from vigil.integrations.lightning import VigilCallback

    trainer = pl.Trainer(strategy="ddp", callbacks=[VigilCallback(job="gpt-small")])

What it does, through `vigil.agent` only (init, watch, step, span, on_control, shutdown):
- at `setup("fit")` it starts the SDK for this rank unless the process already runs a session
  (then it uses that one and leaves its shutdown to its owner), as `vigil.agent.init` does:
  the collector from `$VIGIL_COLLECTOR_URL`, files under `$VIGIL_OUTPUT_DIR`;
- at `on_train_start`, once the strategy has wrapped them, it watches the wrapped model (DDP's
  all-reduce through the SDK's comm hook; FSDP's collectives are recorded at the
  `torch.distributed` functions they call) for forward and backward time;
- one vigil step per optimizer step, numbered by `trainer.global_step` (the value the step's
  `training_step` calls see), spanning every micro-batch of `accumulate_grad_batches`; its
  tokens are the batches' (a user `tokens_fn(batch)`, else `count_tokens`: the `attention_mask`
  sum, else the `input_ids` element count, else 0) and its loss the micro-batches' mean as a
  detached tensor (read by the SDK's background thread: no `.item()` in the training thread);
- the optimizer phase runs from `on_before_optimizer_step` to the end of `optimizer.step`:
  Lightning runs forward and backward inside `optimizer.step(closure)`, so the optimizer's own
  step hooks would count them as optimizer time. The SDK gets a stand-in whose step hooks fire
  at those two points;
- a "checkpoint" control request is honoured at a step's end, the same one on every rank (a
  request reaches each rank's page on its own, and ranks may see it a step apart): the
  framework-neutral `save_agreement.SaveAgreement` agrees without stalling a step (an async
  all-reduce over a gloo group of its own about once a second, at most 16 steps apart, each
  read one step later), then every rank calls `trainer.save_checkpoint(path)`, as Lightning's
  distributed saves require: 1 to 16 step ends after the first rank saw the request, the next
  one when steps take a second or more. `path` is
  `<dir>/vigil-step=<global_step>.ckpt`, `dir` being `checkpoint_dir`, else the trainer's
  `ModelCheckpoint.dirpath`, else `<default_root_dir>/checkpoints`; rank 0 then reports it
  with `vigil.agent.checkpoint_committed` (the record the recovery controller waits for);
- the time from one batch's end to the next batch's start (the loader's fetch and Lightning's
  own between-batch work) is a "data" span; the broadcast Lightning makes there every batch
  (`_broadcast_sigterm_tensor`, whether rank 0 got SIGTERM) is recorded as the job's collective
  like any other (~7 us of the SDK's each): the other ranks wait there for rank 0 between
  batches (its loader, its between-batch work);
- MFU from a `ModelShape` (layers, hidden, heads, seq len; `params=0` counts the module's
  parameters other than its embedding tables, as `vigil.flops` defines N);
- `teardown` (or `on_exception`, which marks the rank failed) shuts the SDK down.

Fail-open: every hook catches its own errors, logs the first few and never raises into training.
This module imports Lightning (`lightning.pytorch`, else `pytorch_lightning`), `vigil.agent` and
its sibling `save_agreement` (torch only); it must not import any other vigil subsystem.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import vigil.agent
from vigil import flops, schema
from vigil.env import EnvVar
from vigil.integrations import save_agreement

if TYPE_CHECKING:
    import lightning.pytorch as pl
else:
    try:
        import lightning.pytorch as pl
    except ImportError:  # the standalone distribution of the same API
        import pytorch_lightning as pl

log = logging.getLogger(__name__)

__all__ = ["VigilCallback", "count_tokens", "model_params"]

_MAX_LOGGED_ERRORS = 5


def count_tokens(batch: Any) -> int:
    """Tokens in one batch: the `attention_mask` sum, else the `input_ids` element count, else
    the element count of a lone integer tensor (token ids); 0 when none of these is found.

    A mask already on a GPU counts by its size, padding included: its sum would have to be read
    back from the device, a sync in every step. Pass `tokens_fn` to count exactly there."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum()) if mask.device.type == "cpu" else mask.numel()
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
        return 0
    if isinstance(batch, list | tuple) and batch:
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and not batch.is_floating_point():
        return batch.numel()
    return 0


def model_params(module: torch.nn.Module) -> int:
    """N of `vigil.flops`: every parameter except input embedding tables (a table that is also a
    linear layer's weight, tied to the output head, counts once)."""
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)}
    tables = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear_weights
    }
    return sum(p.numel() for p in module.parameters() if id(p) not in tables)


class _StepHooks:
    """Stands in for the optimizer in `vigil.agent.watch`: the SDK registers its optimizer-phase
    hooks here, and the callback fires them at Lightning's real optimizer boundaries."""

    def __init__(self) -> None:
        self._pre: list[Callable[..., Any]] = []
        self._post: list[Callable[..., Any]] = []

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> _Handle:
        self._pre.append(hook)
        return _Handle(self._pre, hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> _Handle:
        self._post.append(hook)
        return _Handle(self._post, hook)

    def before_step(self, optimizer: Any) -> None:
        for hook in self._pre:
            hook(optimizer, (), {})

    def after_step(self, optimizer: Any, *_args: Any) -> None:
        for hook in self._post:
            hook(optimizer, (), {})


class _Handle:
    def __init__(self, hooks: list[Callable[..., Any]], hook: Callable[..., Any]) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _size(path: Path) -> int:
    """Bytes of a checkpoint file, or of a sharded checkpoint's folder."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


class VigilCallback(pl.Callback):
    """Ships vigil step records, phases, collectives and control handling for a Lightning fit.

    Keyword-only options (validated here, `ValueError`/`TypeError` on bad values):
    - `job`: the job name; default `$VIGIL_JOB` (set by `vigil run`), else
      `lightning-<torchelastic run id>`, else `lightning-<LightningModule class name>`;
    - `model_shape`: a `vigil.schema.ModelShape` for MFU (`params=0`: counted from the module);
    - `peak_flops`: per-device peak FLOP/s (default: the SDK's table, or a measured CPU peak);
    - `tokens_fn`: `batch -> int` tokens of one batch (default `count_tokens`);
    - `checkpoint_dir`: where "checkpoint" requests save (default: see the module docstring);
    - `enabled`: False makes every hook a no-op (the same trainer, no vigil);
    - more keyword options go to `vigil.agent.init` (collector, output_dir, progress_dir, ...).
    """

    def __init__(
        self,
        *,
        job: str | None = None,
        model_shape: schema.ModelShape | None = None,
        peak_flops: float | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        enabled: bool = True,
        **init_options: Any,
    ) -> None:
        if job is not None and (not isinstance(job, str) or not job):
            raise ValueError(f"job must be a non-empty name, got {job!r}")
        if model_shape is not None and not isinstance(model_shape, schema.ModelShape):
            raise TypeError(f"model_shape must be a vigil.schema.ModelShape, not {model_shape!r}")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0 when given, got {peak_flops}")
        if tokens_fn is not None and not callable(tokens_fn):
            raise TypeError(f"tokens_fn must be callable, got {tokens_fn!r}")
        for reserved in ("job", "model_shape", "flops_per_token", "rank", "world_size"):
            if reserved in init_options:
                raise TypeError(f"{reserved!r} is not an option of VigilCallback")
        self.job = job
        self.model_shape = model_shape
        self.peak_flops = peak_flops
        self.tokens_fn = tokens_fn or count_tokens
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.enabled = enabled
        self.init_options = init_options
        self.errors = 0
        self.checkpoints: list[Path] = []  # what "checkpoint" requests saved, in order
        self._owns_session = False
        self._active = False
        self._hooks = _StepHooks()
        self._post_handles: list[Any] = []
        self._scope: Any = None
        self._handle: Any = None
        self._stepped_at = 0  # trainer.global_step after the last batch seen
        self._agreeing = False
        self._loss: torch.Tensor | None = None
        self._micro = 0
        self._data: Any = None
        self._agreement = save_agreement.SaveAgreement()

    # -- fail-open plumbing ---------------------------------------------------------------
    def _failed(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors <= _MAX_LOGGED_ERRORS:
            log.warning("vigil Lightning callback: %s failed (training continues): %r", where, exc)

    def _job_name(self, pl_module: pl.LightningModule) -> str:
        if self.job:
            return self.job
        if os.environ.get(EnvVar.JOB):
            return os.environ[EnvVar.JOB]
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if run_id and run_id != "none":
            return f"lightning-{run_id}"
        return f"lightning-{type(pl_module).__name__.lower()}"

    # -- set-up ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        try:
            self._start(pl_module)
        except Exception as exc:
            self._failed("setup", exc)

    def _start(self, pl_module: pl.LightningModule) -> None:
        if vigil.agent.current() is not None:
            self._active = True  # the user's own session: theirs to shut down
            ignored = [*self.init_options, *(["model_shape"] if self.model_shape else [])]
            ignored += ["peak_flops"] if self.peak_flops else []
            if self.job or ignored:
                log.warning(
                    "vigil: a session runs already; VigilCallback uses it and ignores %s",
                    ", ".join(["job", *ignored] if self.job else ignored),
                )
            return
        shape = self.model_shape
        if shape is not None and shape.params == 0:
            shape = schema.ModelShape(
                params=model_params(pl_module),
                layers=shape.layers,
                hidden=shape.hidden,
                heads=shape.heads,
                seq_len=shape.seq_len,
            )
        session = vigil.agent.init(
            job=self._job_name(pl_module),
            model_shape=shape,
            flops_per_token=flops.flops_per_token(shape) if shape and shape.params else None,
            peak_flops=self.peak_flops,
            **self.init_options,
        )
        self._owns_session = self._active = session is not None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        self._stepped_at = trainer.global_step
        try:
            # Also where this rank's SDK did not start: the group is made collectively, and
            # each step's agreement needs every rank (one without a session asks for nothing).
            self._agreement.start()
            self._agreeing = True
        except Exception as exc:
            self._failed("train_start", exc)
        if not self._active:
            return
        try:
            wrapped = trainer.strategy.model  # DDP / FSDP have wrapped the module by now
            model = wrapped if wrapped is not None else pl_module
            vigil.agent.watch(model, self._hooks)  # type: ignore[arg-type]  # see _StepHooks
            for optimizer in trainer.optimizers:
                handle = optimizer.register_step_post_hook(self._hooks.after_step)
                self._post_handles.append(handle)
            vigil.agent.on_control("checkpoint", self._agreement.request)
        except Exception as exc:
            self._failed("train_start", exc)

    # -- steps ----------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        try:
            self._close_data()
            if self._scope is None:
                self._scope = vigil.agent.step(trainer.global_step)
                self._handle = self._scope.__enter__()
                self._loss, self._micro = None, 0
            self._handle.tokens += int(self.tokens_fn(batch))
        except Exception as exc:
            self._failed("batch_start", exc)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._active:
            return
        try:
            self._hooks.before_step(optimizer)
        except Exception as exc:
            self._failed("before_optimizer", exc)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        stepped = trainer.global_step != self._stepped_at  # the optimizer stepped in this batch
        self._stepped_at = trainer.global_step
        try:
            if self._active and self._scope is not None:
                self._add_loss(outputs, trainer, pl_module)
                if stepped:
                    self._end_step()
            if stepped and self._agreeing and self._agreement.save_now():
                self._save(trainer)
            if self._active:
                self._open_data()
        except Exception as exc:
            self._failed("batch_end", exc)

    def _add_loss(self, outputs: Any, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach()
            if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
                loss = loss * trainer.accumulate_grad_batches  # Lightning hands it divided
            self._loss = loss if self._loss is None else self._loss + loss
            self._micro += 1

    def _end_step(self) -> None:
        scope, self._scope = self._scope, None
        if self._loss is not None:
            self._handle.set_loss(self._loss / self._micro if self._micro > 1 else self._loss)
        scope.__exit__(None, None, None)  # control callbacks run here, at the boundary

    def _save(self, trainer: pl.Trainer) -> None:
        path = self._checkpoint_root(trainer) / f"vigil-step={trainer.global_step}.ckpt"
        started = time.monotonic()
        with vigil.agent.span("checkpoint"):
            trainer.save_checkpoint(path)  # every rank; it ends in a barrier: all shards written
        seconds = time.monotonic() - started
        self.checkpoints.append(path)
        log.info("vigil: saved %s on request", path)
        report = getattr(vigil.agent, "checkpoint_committed", None)  # newer SDKs
        if report is not None and trainer.global_rank == 0:
            report(
                trainer.global_step - 1,  # the last step it holds, numbered as the records are
                location=str(path.resolve()),
                num_bytes=_size(path),
                save_s=seconds,
                blocked_s=seconds,  # a synchronous save: training waited for all of it
            )

    def _checkpoint_root(self, trainer: pl.Trainer) -> Path:
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir
        callback = trainer.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None)
        if dirpath:
            return Path(dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def _open_data(self) -> None:
        self._data = vigil.agent.span("data")
        self._data.__enter__()

    def _close_data(self) -> None:
        data, self._data = self._data, None
        if data is not None:
            data.__exit__(None, None, None)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            try:
                self._close_data()  # validation is not the next batch's data loading
            except Exception as exc:
                self._failed("batch_start", exc)

    # -- the end --------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._finish()  # inside Lightning's `except`: the SDK marks the rank failed

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()

    def _finish(self) -> None:
        if self._agreeing:
            self._agreeing = False
            try:
                self._agreement.close()
            except Exception as exc:
                self._failed("end", exc)
        if not self._active:
            return
        self._active = False
        try:
            self._close_data()
            scope, self._scope = self._scope, None
            if scope is not None:  # a step the fit ended inside (no optimizer step closed it)
                scope.__exit__(None, None, None)
            for handle in self._post_handles:
                handle.remove()
            self._post_handles.clear()
            if self._owns_session:
                self._owns_session = False
                vigil.agent.shutdown()
        except Exception as exc:
            self._failed("end", exc)
