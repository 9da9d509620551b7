"""Fault injection for the bundled trainer, shared by tests, demos and benchmarks.

Build faults in code (`fail_at(1, 5)`, `hang_at(0, 7, where="collective")`, `slow(1, 3.0)`,
`stall_at(0, 4, seconds=2)`, `nan_at(0, 6)`), or write them as a spec for `--faults` /
`VIGIL_FAULTS`: faults separated by ';', each `kind:key=value,...`, e.g.

    crash:rank=1,step=5;slow:rank=2,factor=3;hang:rank=0,step=9,where=collective

`step` is the optimizer step a fault fires at. A fault fires only in the restart attempt named by
`attempt` (default 0), so a job restarted by a supervisor does not crash again at the same step.
The `Injector` is called by the training loop at fixed points; it must not change anything when
no fault matches, and it never touches checkpoints or the model.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from vigil.trainer.exits import ExitCode

log = logging.getLogger(__name__)

CRASH_EXIT_CODE = int(ExitCode.INJECTED_CRASH)  # so supervisors can tell injected crashes apart
_HANG_POLL_S = 1.0


class FaultKind(enum.StrEnum):
    CRASH = "crash"  # the process exits abruptly at the start of the step
    HANG = "hang"  # the process stops making progress (before or inside a collective)
    SLOW = "slow"  # the rank's compute takes `factor` times as long from `step` on
    STALL = "stall"  # the data loader blocks for `seconds` at the step
    NAN = "nan"  # the rank's loss becomes NaN at the step


class HangWhere(enum.StrEnum):
    BEFORE = "before"  # never reaches the step's collectives; peers wait inside them
    COLLECTIVE = "collective"  # enters a collective that no peer joins


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    kind: FaultKind
    rank: int
    step: int = 0
    where: HangWhere = HangWhere.BEFORE
    factor: float = 1.0
    seconds: float = 0.0  # stall length; for a hang 0 means "until killed"
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0 or self.attempt < 0:
            raise ValueError(f"fault {self.kind}: rank, step and attempt must be >= 0")
        if self.kind is FaultKind.SLOW and self.factor < 1.0:
            raise ValueError(f"slow fault needs factor >= 1, got {self.factor}")
        if self.kind is FaultKind.STALL and self.seconds <= 0:
            raise ValueError("stall fault needs seconds > 0")
        if self.seconds < 0:
            raise ValueError("fault seconds must be >= 0")

    def to_spec(self) -> str:
        fields = [f"rank={self.rank}", f"step={self.step}"]
        if self.kind is FaultKind.HANG:
            fields.append(f"where={self.where}")
        if self.kind is FaultKind.SLOW:
            fields.append(f"factor={self.factor}")
        if self.seconds:
            fields.append(f"seconds={self.seconds}")
        if self.attempt:
            fields.append(f"attempt={self.attempt}")
        return f"{self.kind}:{','.join(fields)}"


def fail_at(rank: int, step: int, *, attempt: int = 0) -> Fault:
    return Fault(kind=FaultKind.CRASH, rank=rank, step=step, attempt=attempt)


def hang_at(
    rank: int, step: int, where: str = "before", *, seconds: float = 0.0, attempt: int = 0
) -> Fault:
    return Fault(
        kind=FaultKind.HANG,
        rank=rank,
        step=step,
        where=HangWhere(where),
        seconds=seconds,
        attempt=attempt,
    )


def slow(rank: int, factor: float, *, from_step: int = 0, attempt: int = 0) -> Fault:
    return Fault(kind=FaultKind.SLOW, rank=rank, step=from_step, factor=factor, attempt=attempt)


def stall_at(rank: int, step: int, *, seconds: float, attempt: int = 0) -> Fault:
    return Fault(kind=FaultKind.STALL, rank=rank, step=step, seconds=seconds, attempt=attempt)


def nan_at(rank: int, step: int, *, attempt: int = 0) -> Fault:
    return Fault(kind=FaultKind.NAN, rank=rank, step=step, attempt=attempt)


_CONVERTERS: dict[str, Callable[[str], object]] = {
    "rank": int,
    "step": int,
    "attempt": int,
    "factor": float,
    "seconds": float,
    "where": HangWhere,
}


def _parse_one(text: str) -> Fault:
    kind_text, _, rest = text.partition(":")
    try:
        kind = FaultKind(kind_text.strip())
    except ValueError:
        kinds = ", ".join(k.value for k in FaultKind)
        problem = f"unknown fault kind {kind_text!r} in {text!r}; use one of {kinds}"
        raise ValueError(problem) from None
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _CONVERTERS:
            raise ValueError(
                f"bad fault field {item!r} in {text!r}; fields are {', '.join(_CONVERTERS)}"
            )
        try:
            values[key] = _CONVERTERS[key](value)
        except ValueError:
            raise ValueError(f"fault field {key}={value!r} in {text!r} is not valid") from None
    if "rank" not in values:
        raise ValueError(f"fault {text!r} needs rank=N")
    return Fault(kind=kind, **values)  # type: ignore[arg-type]


def parse(spec: str | None) -> list[Fault]:
    """Faults from a spec string (see the module docstring); '' or None means none."""
    if not spec:
        return []
    return [_parse_one(part) for part in spec.split(";") if part.strip()]


def to_spec(faults: Iterable[Fault]) -> str:
    return ";".join(f.to_spec() for f in faults)


class Injector:
    """Carries out the faults aimed at one rank in one restart attempt."""

    def __init__(
        self,
        faults: Iterable[Fault],
        *,
        rank: int,
        attempt: int = 0,
        sleep: Callable[[float], None] = time.sleep,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]
        self.rank = rank
        self._sleep = sleep
        self._exit = exit_process
        self._hang_group: dist.ProcessGroup | None = None
        for fault in self.faults:
            log.warning("fault armed on rank %d: %s", rank, fault.to_spec())

    def _matching(self, kind: FaultKind, step: int) -> Fault | None:
        for fault in self.faults:
            if fault.kind is kind and fault.step == step:
                return fault
        return None

    def set_hang_group(self, group: dist.ProcessGroup | None) -> None:
        """A group every rank joined but only a hanging rank ever uses."""
        self._hang_group = group

    def at_step_start(self, step: int) -> None:
        if self._matching(FaultKind.CRASH, step):
            log.error("injected crash: rank %d exits at step %d", self.rank, step)
            logging.shutdown()
            self._exit(CRASH_EXIT_CODE)
        hang = self._matching(FaultKind.HANG, step)
        if hang is not None:
            self._hang(hang, step)

    def _hang(self, fault: Fault, step: int) -> None:
        log.error("injected hang (%s) on rank %d at step %d", fault.where, self.rank, step)
        if fault.where is HangWhere.COLLECTIVE and self._hang_group is not None:
            # No peer ever joins this all_reduce: the rank blocks inside a real collective.
            dist.all_reduce(torch.zeros(1), group=self._hang_group)
            return
        if fault.seconds:
            self._sleep(fault.seconds)
            return
        while True:  # until a supervisor kills the process
            self._sleep(_HANG_POLL_S)

    def on_data(self, step: int) -> None:
        stall = self._matching(FaultKind.STALL, step)
        if stall is not None:
            log.warning("injected data stall of %.1fs on rank %d", stall.seconds, self.rank)
            self._sleep(stall.seconds)

    def slow_factor(self, step: int) -> float:
        factors = [f.factor for f in self.faults if f.kind is FaultKind.SLOW and step >= f.step]
        return max(factors, default=1.0)

    def after_compute(self, step: int, compute_s: float) -> None:
        """Stretch this step's compute to `factor` times its measured length."""
        factor = self.slow_factor(step)
        if factor > 1.0:
            self._sleep((factor - 1.0) * compute_s)

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self._matching(FaultKind.NAN, step):
            log.error("injected NaN loss on rank %d at step %d", self.rank, step)
            return loss * float("nan")
        return loss
