"""What one diagnostic measured on one device, before it is judged.

A `Measurement` is the neutral output of every diagnostic (GEMM, bandwidth, SDC, memory test,
collectives, clocks): a named value with its unit, which direction is better and whether it is
a performance figure, a correctness count or context. `vigil.kernels.verdict` judges it and
turns it into a `vigil.schema.DiagResult`. No kernels, no I/O here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Kind(enum.StrEnum):
    PERF = "perf"  # judged against the fleet median and the spec sheet
    ERRORS = "errors"  # a count of wrong results: anything above zero fails
    CHECKSUM = "checksum"  # must equal the exact reference and the fleet's value bit for bit
    INFO = "info"  # context (coverage, clock readings): never judged on its own


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One figure: e.g. test="gemm.bf16.triton", value=712.4, unit="TFLOP/s"."""

    test: str
    value: float
    unit: str
    kind: Kind = Kind.PERF
    higher_is_better: bool = True
    # Key into the device's spec sheet (`vigil.kernels.spec`), empty when there is none.
    spec_key: str = ""
    # The exact value a checksum must have (computed independently of the device under test).
    expected: float | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if not self.test:
            raise ValueError("a measurement needs a test name")
        if math.isnan(self.value):
            raise ValueError(f"{self.test}: value is NaN; report a failed test as an error count")
        if self.kind is Kind.ERRORS and self.value < 0:
            raise ValueError(f"{self.test}: an error count cannot be negative ({self.value})")
