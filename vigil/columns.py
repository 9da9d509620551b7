"""Step records as float64 columns: one C-level pass shared by the collector and the analyzer.

Each Python-level pass over a batch of 8,192 step records costs milliseconds. The collector's
checks, its heatmap patch and the streaming analyzer's window all read the same numeric fields,
so a batch is converted once (`from_rows`) and the arrays are handed on. Integer fields are exact
up to 2**53 as float64 (ranks, steps and token counts are far below). Pure; numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from vigil import schema

FIELDS: tuple[str, ...] = schema.StepRecord.__struct_fields__
# Every field but the job name and the optional loss.
NUMERIC: tuple[str, ...] = tuple(f for f in FIELDS if f not in ("job_id", "loss"))
_INDEX = {name: i for i, name in enumerate(NUMERIC)}
_JOB = FIELDS.index("job_id")
_PICK = itemgetter(*(FIELDS.index(f) for f in NUMERIC))


@dataclass(frozen=True, eq=False)
class StepColumns:
    """`values[i, j]`: field NUMERIC[j] of record i (record order); `job_ids[i]` its job."""

    values: npt.NDArray[np.float64]
    job_ids: list[str]

    def __post_init__(self) -> None:
        if self.values.shape != (len(self.job_ids), len(NUMERIC)):
            raise ValueError(
                f"step columns: values shaped {self.values.shape}, expected "
                f"({len(self.job_ids)}, {len(NUMERIC)})"
            )

    def __len__(self) -> int:
        return len(self.job_ids)

    def column(self, name: str) -> npt.NDArray[np.float64]:
        """One field of every record (a view, not a copy)."""
        values: npt.NDArray[np.float64] = self.values[:, _INDEX[name]]
        return values

    def jobs(self) -> set[str]:
        return set(self.job_ids)

    def of_job(self, job_id: str) -> StepColumns:
        """The records of one job (self when the batch holds no other)."""
        if self.jobs() == {job_id}:
            return self
        mask = np.fromiter((j == job_id for j in self.job_ids), dtype=bool, count=len(self))
        return StepColumns(
            values=self.values[mask], job_ids=[j for j in self.job_ids if j == job_id]
        )


def from_rows(rows: Sequence[tuple[Any, ...]]) -> StepColumns:
    """Columns of step records given as `msgspec.structs.astuple` tuples."""
    n = len(rows)
    flat = chain.from_iterable(map(_PICK, rows))
    values = np.fromiter(flat, dtype=np.float64, count=n * len(NUMERIC)).reshape(n, len(NUMERIC))
    return StepColumns(values=values, job_ids=list(map(itemgetter(_JOB), rows)))


def from_records(records: Sequence[schema.StepRecord]) -> StepColumns:
    return from_rows(list(map(msgspec.structs.astuple, records)))


def index(name: str) -> int:
    """Position of a NUMERIC field in `StepColumns.values`."""
    return _INDEX[name]
