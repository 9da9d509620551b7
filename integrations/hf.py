"""vigil inside the Hugging Face `Trainer`: `VigilCallback`, a `transformers.TrainerCallback`.

    from vigil.integrations.hf import VigilCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[VigilCallback()])

or, by name through `report_to` (`enable()` says why it is needed):

    import vigil.integrations.hf
    vigil.integrations.hf.enable()
    args = TrainingArguments(..., report_to=["vigil"])

What the callback does, through the public SDK (`vigil.agent`) alone:
- at train begin it starts the rank's SDK session unless one is running (`vigil.agent.init`,
  which reads the environment as always: $VIGIL_COLLECTOR_URL, $VIGIL_OUTPUT_DIR, rank and
  world size from torch.distributed), with the model shape MFU needs (`hf_shape`); it watches
  the model Trainer trains (the DDP wrapper accelerate made, so DDP's gradient all-reduce is
  timed, or the FSDP model: `Trainer.model_wrapped`, read from the Trainer whose callback
  handler calls `on_train_begin`, since callbacks are handed the unwrapped model) and the
  optimizer inside accelerate's wrapper; it shuts the session down at train end when it
  started it;
- one vigil step per optimizer step, numbered as Trainer's `state.global_step` after that step
  (1, 2, ...), whatever `gradient_accumulation_steps` is; tokens from each micro-batch's inputs
  (the attention mask's sum, else the input ids' count), summed over the step, per rank; the loss
  as Trainer counts it for this rank (the model's loss of each micro-batch, averaged over the
  step, or summed and scaled by the ranks when Trainer normalises it by the step's items), a
  detached tensor the SDK reads off the training thread, so no device sync;
- a "checkpoint" request sets `control.should_save` at a step end every rank agrees on
  (`save_agreement`: 1 to 16 step ends after the first rank saw the request, the next one when
  steps take a second or more), so Trainer writes its own `checkpoint-N` folder; once Trainer
  has saved one (on request or by its own `save_strategy`), world rank 0 reports it to vigil
  (`vigil.agent.checkpoint_committed`: step, folder, bytes, save time).

Data loading is outside the step records: Trainer fetches a step's micro-batches before
`on_step_begin` and offers callbacks no hook around it, so a slow loader is not reported as a
data stall. Token counts on an accelerator: a mask already on the device is counted by its
size (padding included), since summing it would wait for the device every step; on CPU the
mask's sum is exact.

Fail-open like the SDK: every hook catches its own errors, counts them in the session's error
count (logged), and training goes on. Must not import any vigil subsystem but `vigil.agent`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types
from typing import Any

import torch
import transformers

import vigil.agent
from vigil.agent import sdk
from vigil.env import EnvVar
from vigil.integrations import hf_shape, save_agreement

log = logging.getLogger(__name__)

__all__ = ["REPORT_TO_NAME", "VigilCallback", "enable"]

REPORT_TO_NAME = "vigil"
# How far up the stack the Trainer that calls on_train_begin sits (Trainer → CallbackHandler
# → call_event → the callback: 3 in transformers 5.x; a margin for subclasses' wrappers).
_TRAINER_FRAMES = 8


class VigilCallback(transformers.TrainerCallback):
    """Step records, phases, collectives, MFU and "checkpoint now" for a Trainer job.

    `job`: the vigil job id (default $VIGIL_JOB, else Trainer's `run_name`, else the output
    folder's name; every rank must report the same). `collector`: as `vigil.agent.init`'s (left
    out: $VIGIL_COLLECTOR_URL). `seq_len`: the training sequence length for MFU (default: the
    first training sample's length, else the model's maximum). `watch=False` leaves a session
    the user started and watched alone. More keyword options go to `vigil.agent.init`.
    """

    def __init__(
        self,
        *,
        job: str | None = None,
        collector: str | sdk.FromEnvironment | None = sdk.FROM_ENV,
        seq_len: int | None = None,
        watch: bool = True,
        **init_options: Any,
    ) -> None:
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
            raise ValueError(f"seq_len must be a positive number of tokens, got {seq_len!r}")
        if job is not None and (not job or "/" in job):
            raise ValueError(f"job {job!r} must be a non-empty name without '/'")
        self._job = job
        self._collector = collector
        self._seq_len = seq_len
        self._watch = watch
        self._init_options = init_options
        self._shape_model: torch.nn.Module | None = None
        self._reset()

    def _reset(self) -> None:
        self._owns_session = False
        self._active = False  # this rank's session runs: steps are recorded
        self._agreeing = False  # this rank takes part in the checkpoint agreement
        self._saving_since = 0.0
        self._scope: Any = None
        self._handle: Any = None
        self._hooks: list[Any] = []
        self._agreement = save_agreement.SaveAgreement()
        self._micro = _MicroBatches()

    # -- errors ---------------------------------------------------------------------------
    def _error(self, exc: BaseException) -> None:
        session = vigil.agent.current()
        if session is not None:
            session.count_error(exc)
        else:
            log.warning("vigil Trainer callback error (training continues): %r", exc)

    # -- Trainer events -------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainer's own model, before accelerate wraps or shards it: the shape's true sizes.
        model = kwargs.get("model")
        self._shape_model = model if isinstance(model, torch.nn.Module) else None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._reset()
        try:
            self._begin(args, kwargs, _calling_trainer())
        except Exception as exc:
            self._error(exc)
        # Every rank joins the agreement, whether its own session started or not: a rank
        # that left it out would leave its peers waiting in its collectives.
        try:
            self._agreement.start()
            self._agreeing = True
        except Exception as exc:
            self._error(exc)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._active:
            return
        try:
            self._micro.reset()
            self._scope = vigil.agent.step(state.global_step + 1)
            self._handle = self._scope.__enter__()
        except Exception as exc:
            self._error(exc)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._active:
            try:
                self._end_step(args)
            except Exception as exc:
                self._error(exc)
        if not self._agreeing:
            return None
        try:
            if self._agreement.save_now():
                log.info("vigil: checkpoint requested: saving at step %d", state.global_step)
                control.should_save = True
            self._saving_since = time.monotonic()  # Trainer saves after on_step_end returns
        except Exception as exc:
            self._error(exc)
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._active or not getattr(state, "is_world_process_zero", True):
            return
        try:
            _report_checkpoint(args, state, self._saving_since)
        except Exception as exc:
            self._error(exc)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._agreeing:
            self._agreeing = False
            try:
                self._agreement.close()
            except Exception as exc:
                self._error(exc)
        if not self._active:
            return
        try:
            self._finish()
        except Exception as exc:
            self._error(exc)

    # -- the work -------------------------------------------------------------------------
    def _begin(self, args: Any, kwargs: dict[str, Any], trainer: Any) -> None:
        model = kwargs.get("model")
        # DDP's all-reduce runs in C++ and is reached only through its wrapper's comm hook;
        # callbacks are handed Trainer's unwrapped model, its caller holds the wrapper.
        wrapped = getattr(trainer, "model_wrapped", None)
        wrapped = model if wrapped is None else wrapped  # (no `or`: a Sequential may be empty)
        if not isinstance(wrapped, torch.nn.Module):
            log.warning("vigil: Trainer gave no model to watch; steps only")
            wrapped = None
        if vigil.agent.current() is None:
            shape = self._shape(model, kwargs.get("train_dataloader"))
            options = {**self._init_options}
            if shape is not None:
                options.setdefault("model_shape", shape)
            session = vigil.agent.init(
                job=self._job or _job_name(args), collector=self._collector, **options
            )
            if session is None:  # init logged why; training runs on without vigil
                return
            self._owns_session = True
        self._active = True
        if self._watch and wrapped is not None:
            optimizer = kwargs.get("optimizer")
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds it
            inner = inner if isinstance(inner, torch.optim.Optimizer) else None
            vigil.agent.watch(wrapped, inner)
        if wrapped is not None:
            self._hooks.append(
                wrapped.register_forward_pre_hook(self._micro.before_forward, with_kwargs=True)
            )
            self._hooks.append(wrapped.register_forward_hook(self._micro.after_forward))
        vigil.agent.on_control("checkpoint", self._agreement.request)

    def _shape(self, model: Any, dataloader: Any) -> Any:
        source = model if self._shape_model is None else self._shape_model
        if not isinstance(source, torch.nn.Module):
            return None
        seq_len = self._seq_len or hf_shape.train_seq_len(source, dataloader)
        return hf_shape.model_shape(source, seq_len)

    def _end_step(self, args: Any) -> None:
        scope, handle = self._scope, self._handle
        self._scope = self._handle = None
        if scope is None:
            return
        micro = self._micro
        handle.tokens = micro.tokens
        loss = micro.step_loss(world_size=_loss_scale(args))
        if loss is not None:
            handle.set_loss(loss)
        scope.__exit__(None, None, None)  # runs control callbacks (the SDK's step boundary)

    def _finish(self) -> None:
        self._active = False
        if self._scope is not None:  # a step Trainer did not end (training stopped in it)
            scope, self._scope, self._handle = self._scope, None, None
            scope.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._owns_session:
            self._owns_session = False
            vigil.agent.shutdown()


class _MicroBatches:
    """Tokens and losses of the current optimizer step's micro-batches (forward hooks)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.count = 0
        self.loss: torch.Tensor | None = None
        self.normalised = False  # Trainer passed num_items_in_batch: the model divides by it

    def before_forward(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        try:
            if not (module.training and torch.is_grad_enabled()):
                return  # evaluation inside a step (a user's callback): not training tokens
            self.tokens += _tokens(args, kwargs)
            self.normalised = self.normalised or kwargs.get("num_items_in_batch") is not None
        except Exception as exc:
            _count(exc)

    def after_forward(self, module: Any, args: Any, output: Any) -> None:
        try:
            if not (module.training and torch.is_grad_enabled()):
                return
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                # A copy: Trainer scales the loss in place after the forward (compute_loss).
                loss = loss.detach().reshape(())
                self.loss = loss.clone() if self.loss is None else self.loss + loss
                self.count += 1
        except Exception as exc:
            _count(exc)

    def step_loss(self, *, world_size: int) -> torch.Tensor | None:
        """Trainer's loss of this step on this rank, as a device tensor (never synced here)."""
        if self.loss is None or self.count == 0:
            return None
        if self.normalised:  # each micro-batch's loss is its share of the step's items
            return self.loss * world_size if world_size > 1 else self.loss
        return self.loss / self.count


def _tokens(args: Any, kwargs: dict[str, Any]) -> int:
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if mask.device.type == "cpu":
            return int(mask.sum())
        return mask.numel()  # on a device: its sum would wait for the device (module docstring)
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


def _count(exc: BaseException) -> None:
    session = vigil.agent.current()
    if session is not None:
        session.count_error(exc)


def _loss_scale(args: Any) -> int:
    """The factor Trainer multiplies a normalised loss by: its processes when it averages the
    step's items across devices (`average_tokens_across_devices`), else 1."""
    if not getattr(args, "average_tokens_across_devices", False):
        return 1
    world = getattr(args, "world_size", 1)
    return world if isinstance(world, int) and world > 1 else 1


def _job_name(args: Any) -> str:
    """$VIGIL_JOB, else Trainer's run name, else its output folder's name (same on all ranks)."""
    from_env = os.environ.get(EnvVar.JOB)
    if from_env:
        return from_env
    for name in (getattr(args, "run_name", None), getattr(args, "output_dir", None)):
        if isinstance(name, str) and name.strip("/"):
            return os.path.basename(os.path.normpath(name)).replace("/", "-") or "hf-trainer"
    return "hf-trainer"


def _report_checkpoint(args: Any, state: Any, since: float) -> None:
    """Tell vigil (the recovery controller's "checkpoint now" waits for it) that Trainer's
    `checkpoint-<global_step>` folder is written."""
    folder = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
    if not os.path.isdir(folder):  # a save elsewhere (a subclass's): nothing to point at
        return
    size = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
    )
    seconds = max(0.0, time.monotonic() - since) if since else 0.0
    vigil.agent.checkpoint_committed(
        state.global_step, location=folder, num_bytes=size, save_s=seconds, blocked_s=seconds
    )


def _calling_trainer() -> Any:
    """The `transformers.Trainer` whose callback handler called us (None when there is none)."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_TRAINER_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer):
            return owner
        frame = frame.f_back
    return None


def enable() -> None:
    """Make `TrainingArguments(report_to=["vigil"])` add a `VigilCallback()` (idempotent).

    transformers resolves `report_to` names through one dict,
    `transformers.integrations.integration_utils.INTEGRATION_TO_CALLBACK`, read when a
    Trainer is made, and offers no registration hook or entry point for names outside it; this
    adds "vigil" to that dict, nothing else (no function of transformers is replaced). Call it
    before making the Trainer. `report_to="all"` still means transformers' own list. Raises
    RuntimeError when this transformers has no such dict (pass `callbacks=[VigilCallback()]`
    then)."""
    from transformers.integrations import integration_utils

    registry = getattr(integration_utils, "INTEGRATION_TO_CALLBACK", None)
    if not isinstance(registry, dict):
        raise RuntimeError(
            f"transformers {transformers.__version__} resolves report_to without "
            "integration_utils.INTEGRATION_TO_CALLBACK; pass callbacks=[VigilCallback()] instead"
        )
    registry[REPORT_TO_NAME] = VigilCallback
