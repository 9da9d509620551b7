"""Forward / backward / optimizer phase timing through module and optimizer hooks.

`PhaseTimer.watch(model, optimizer)` installs:
- a forward pre-hook and forward hook on the root module (forward time, summed over micro-batches);
- a tensor hook on the forward output's first grad-requiring tensor: it fires when the gradient of
  the output arrives, i.e. when backward reaches the model; backward ends at the optimizer step,
  the next forward or the step's end, whichever comes first;
- optimizer step pre/post hooks (optimizer time).

Hooks only read a monotonic clock and add to floats; they never raise into training (errors are
counted through `on_error`). No I/O, no torch.distributed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values: Any = output.values() if isinstance(output, dict) else output
    if isinstance(values, list | tuple) or hasattr(values, "__iter__"):
        for item in values:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return item
    return None


class PhaseTimer:
    """Per-step sums of forward, backward and optimizer seconds for one watched model."""

    def __init__(
        self,
        *,
        on_error: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._on_error = on_error
        self._handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.optimizer_s = 0.0
        self._forward_start: float | None = None
        self._backward_start: float | None = None
        self._optimizer_start: float | None = None

    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._handles.append(model.register_forward_pre_hook(self._pre_forward))
        self._handles.append(model.register_forward_hook(self._post_forward))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_optimizer))
            self._handles.append(optimizer.register_step_post_hook(self._post_optimizer))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def end_backward(self, now: float | None = None) -> None:
        """Close an open backward phase (called at optimizer start, next forward, step end)."""
        if self._backward_start is not None:
            now = self._clock() if now is None else now
            self.backward_s += max(0.0, now - self._backward_start)
            self._backward_start = None

    def take(self) -> tuple[float, float, float]:
        """(forward_s, backward_s, optimizer_s) of the step that just ended; resets the sums."""
        self.end_backward()
        sums = (self.forward_s, self.backward_s, self.optimizer_s)
        self.reset()
        return sums

    # -- hooks (fail-open) ----------------------------------------------------------------
    def _pre_forward(self, _module: Any, _args: Any) -> None:
        try:
            now = self._clock()
            self.end_backward(now)
            self._forward_start = now
        except Exception as exc:
            self._on_error(exc)

    def _post_forward(self, _module: Any, _args: Any, output: Any) -> None:
        try:
            if self._forward_start is not None:
                self.forward_s += self._clock() - self._forward_start
                self._forward_start = None
            tensor = _first_grad_tensor(output) if torch.is_grad_enabled() else None
            if tensor is not None:
                tensor.register_hook(self._on_output_grad)  # type: ignore[no-untyped-call]
        except Exception as exc:
            self._on_error(exc)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        try:
            if self._backward_start is None:
                self._backward_start = self._clock()
        except Exception as exc:
            self._on_error(exc)

    def _pre_optimizer(self, *_args: Any) -> None:
        try:
            now = self._clock()
            self.end_backward(now)
            self._optimizer_start = now
        except Exception as exc:
            self._on_error(exc)

    def _post_optimizer(self, *_args: Any) -> None:
        try:
            if self._optimizer_start is not None:
                self.optimizer_s += self._clock() - self._optimizer_start
                self._optimizer_start = None
        except Exception as exc:
            self._on_error(exc)
