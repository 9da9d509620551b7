"""The trainer's one doorway to the vigil SDK (`vigil.agent`): init, watch, step, span,
on_control, checkpoint_committed, shutdown — exactly the API of docs/architecture.md's SDK
section.

Every call is fail-open twice over: the SDK promises never to raise, and this module also turns
an SDK that is missing (an older install) or broken into a logged no-op, so telemetry can never
stop training. Nothing else in vigil.trainer imports vigil.agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn, optim

from vigil import schema

log = logging.getLogger(__name__)


class _NoLoss:
    def set_loss(self, loss: float) -> None:
        del loss


def _sdk_function(name: str) -> Callable[..., Any] | None:
    try:
        from vigil import agent
    except Exception as exc:  # an SDK that fails to import must not stop training
        log.warning("vigil SDK unavailable (%s); training without telemetry", exc)
        return None
    function = getattr(agent, name, None)
    return function if callable(function) else None


class Telemetry:
    """Thin wrapper over `vigil.agent`; `enabled=False` makes every method a no-op."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.errors = 0
        self._missing_logged = False

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return None
        function = _sdk_function(name)
        if function is None:
            if not self._missing_logged:
                log.warning("vigil.agent.%s is not available; telemetry is off", name)
                self._missing_logged = True
            return None
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            self.errors += 1
            log.warning("vigil.agent.%s failed (%s); training continues", name, exc)
            return None

    def start(
        self,
        *,
        job: str,
        rank: int,
        world_size: int,
        model_shape: schema.ModelShape,
        flops_per_token: float,
        peak_flops: float | None,
        output_dir: str | os.PathLike[str] | None,
        collector: str | None,
        **more: Any,
    ) -> None:
        # No URL given: leave the SDK's default, which reads $VIGIL_COLLECTOR_URL (the trainer's
        # documented fallback); the SDK takes an explicit None as "no collector".
        if collector is not None:
            more["collector"] = collector
        self._call(
            "init",
            job=job,
            output_dir=output_dir,
            rank=rank,
            world_size=world_size,
            model_shape=model_shape,
            flops_per_token=flops_per_token,
            peak_flops=peak_flops,
            **more,
        )

    def watch(self, model: nn.Module, optimizer: optim.Optimizer | None) -> None:
        self._call("watch", model, optimizer)

    @contextlib.contextmanager
    def step(self, step: int, *, tokens: int) -> Iterator[Any]:
        manager = self._call("step", step, tokens=tokens)
        if manager is None:
            yield _NoLoss()
            return
        with manager as handle:
            yield handle if handle is not None else _NoLoss()

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        manager = self._call("span", name)
        if manager is None:
            yield
            return
        with manager:
            yield

    def on_control(self, kind: str, callback: Callable[..., Any]) -> None:
        self._call("on_control", kind, callback)

    def checkpoint_committed(self, step: int, *, location: str, **details: Any) -> None:
        """Report a committed checkpoint (`vigil.agent.checkpoint_committed`; safe from any
        thread: DCP's writer thread commits an async save)."""
        self._call("checkpoint_committed", step, location=location, **details)

    def shutdown(self) -> None:
        self._call("shutdown")
