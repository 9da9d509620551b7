"""Step records as float64 columns: one C-level pass shared by the collector and the analyzer.

Each Python-level pass over a batch of 8,192 step records costs milliseconds. The collector's
checks, its heatmap patch and the streaming analyzer's window all read the same numeric fields,
so a batch is converted once (`from_rows`) and the arrays are handed on. Integer fields are exact
up to 2**53 as float64 (ranks, steps and token counts are far below).

The wire's columnar step block (`schema.StepBlock`) is these columns packed: `to_block` packs
records, `from_block` checks a received block against StepRecord's constraints and unpacks it
without a Python-level pass; `rows` and `to_records` turn columns back into field tuples or
records. Pure; numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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
_LOSS = itemgetter(FIELDS.index("loss"))
_PICK = itemgetter(*(FIELDS.index(f) for f in NUMERIC))
# Fields a block must carry (the others have defaults), and the integer ones.
REQUIRED: tuple[str, ...] = tuple(
    f.name for f in msgspec.structs.fields(schema.StepRecord) if f.required and f.name in _INDEX
)
_DEFAULTS = np.array(
    [
        0.0 if f.required else float(f.default)
        for f in msgspec.structs.fields(schema.StepRecord)
        if f.name in _INDEX
    ]
)
INTEGERS: tuple[str, ...] = tuple(
    f.name
    for f in msgspec.structs.fields(schema.StepRecord)
    if f.name in _INDEX and f.type in (int, schema.NonNegInt)
)
_INT_COLS = [_INDEX[f] for f in INTEGERS]
EXACT_LIMIT = 2.0**53  # float64 holds every whole number below this exactly


class BlockError(ValueError):
    """A step block that breaks StepRecord's constraints: names the field and the record."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"StepRecord.{field}: {problem}")


@dataclass(frozen=True, eq=False)
class StepColumns:
    """`values[i, j]`: field NUMERIC[j] of record i (record order); `job_ids[i]` its job;
    `loss[i]` its loss (NaN: unknown) when the columns carry it (those unpacked from a block)."""

    values: npt.NDArray[np.float64]
    job_ids: list[str]
    loss: npt.NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        if self.values.shape != (len(self.job_ids), len(NUMERIC)):
            raise ValueError(
                f"step columns: values shaped {self.values.shape}, expected "
                f"({len(self.job_ids)}, {len(NUMERIC)})"
            )
        if self.loss is not None and self.loss.shape != (len(self.job_ids),):
            raise ValueError(
                f"step columns: loss shaped {self.loss.shape}, expected ({len(self)},)"
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
        return self.take(
            np.fromiter((j == job_id for j in self.job_ids), dtype=bool, count=len(self))
        )

    def take(self, mask: npt.NDArray[np.bool_]) -> StepColumns:
        """The records where `mask` is True, in their order."""
        return StepColumns(
            values=self.values[mask],
            job_ids=[j for j, keep in zip(self.job_ids, mask.tolist(), strict=True) if keep],
            loss=None if self.loss is None else self.loss[mask],
        )


def from_rows(rows: Sequence[tuple[Any, ...]]) -> StepColumns:
    """Columns of step records given as `msgspec.structs.astuple` tuples."""
    n = len(rows)
    flat = chain.from_iterable(map(_PICK, rows))
    values = np.fromiter(flat, dtype=np.float64, count=n * len(NUMERIC)).reshape(n, len(NUMERIC))
    return StepColumns(values=values, job_ids=list(map(itemgetter(_JOB), rows)))


def from_records(records: Sequence[schema.StepRecord]) -> StepColumns:
    return from_rows(list(map(msgspec.structs.astuple, records)))


def concat(parts: Sequence[StepColumns]) -> StepColumns:
    """Several batches' columns as one, in the order given (their loss only if all carry it)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return StepColumns(values=np.zeros((0, len(NUMERIC))), job_ids=[])
    losses = [p.loss for p in parts if p.loss is not None]
    return StepColumns(
        values=np.concatenate([p.values for p in parts]),
        job_ids=list(chain.from_iterable(p.job_ids for p in parts)),
        loss=np.concatenate(losses) if len(losses) == len(parts) else None,
    )


def index(name: str) -> int:
    """Position of a NUMERIC field in `StepColumns.values`."""
    return _INDEX[name]


def to_block(records: Sequence[schema.StepRecord]) -> schema.StepBlock | None:
    """Step records packed as one wire block; None when a value cannot travel exactly as float64
    (an integer field at or above 2**53: the caller then sends the records as they are)."""
    tuples = list(map(msgspec.structs.astuple, records))
    cols = from_rows(tuples)
    ints = cols.values[:, _INT_COLS]
    if ints.size and not (ints < EXACT_LIMIT).all():
        return None
    job_ids = list(dict.fromkeys(cols.job_ids))
    if len(job_ids) == 1:
        jobs = np.zeros(len(cols), dtype="<u4")
    else:
        index = {job: i for i, job in enumerate(job_ids)}
        jobs = np.fromiter(map(index.__getitem__, cols.job_ids), dtype="<u4", count=len(cols))
    return schema.StepBlock(
        fields=list(NUMERIC),
        job_ids=job_ids,
        jobs=jobs.tobytes(),
        values=cols.values.astype("<f8").tobytes(),
        # None (unknown) becomes NaN.
        loss=np.array(list(map(_LOSS, tuples)), dtype="<f8").reshape(len(tuples)).tobytes(),
    )


def from_block(block: schema.StepBlock) -> StepColumns:
    """Unpack a received block, checked against StepRecord's constraints (every number >= 0,
    integer fields whole, end_s >= start_s); raises BlockError naming field and record."""
    fields = block.fields
    unknown = sorted(set(fields) - set(NUMERIC))
    if unknown:
        known = ", ".join(NUMERIC)
        raise BlockError(unknown[0], f"not a numeric StepRecord field (fields: {known})")
    if len(set(fields)) != len(fields):
        raise BlockError("<block>", "fields lists a field twice")
    missing = [f for f in REQUIRED if f not in fields]
    if missing:
        raise BlockError(missing[0], "required, but the block has no such column")
    width = len(fields)
    if len(block.values) % (8 * width):
        raise BlockError("<block>", f"values: {len(block.values)} bytes is not whole records")
    n = len(block.values) // (8 * width)
    packed = np.frombuffer(block.values, dtype="<f8").reshape(n, width)
    if list(fields) == list(NUMERIC):
        values = packed.astype(np.float64)  # a writable copy in native order
    else:
        values = np.tile(_DEFAULTS, (n, 1))
        values[:, [_INDEX[f] for f in fields]] = packed
    if len(block.jobs) != 4 * n:
        raise BlockError("job_id", f"jobs: {len(block.jobs)} bytes for {n} records (4 each)")
    jobs = np.frombuffer(block.jobs, dtype="<u4")
    if n and int(jobs.max()) >= len(block.job_ids):
        first = int(np.argmax(jobs >= len(block.job_ids)))
        raise BlockError("job_id", f"record {first}: job index {jobs[first]} is not in job_ids")
    if block.loss and len(block.loss) != 8 * n:
        raise BlockError("loss", f"{len(block.loss)} bytes for {n} records (8 each, or none)")
    loss = (
        np.frombuffer(block.loss, dtype="<f8").astype(np.float64)
        if block.loss
        else np.full(n, math.nan)
    )
    _check_block_values(values)
    if len(block.job_ids) == 1:
        job_ids = [block.job_ids[0]] * n
    else:
        job_ids = list(map(block.job_ids.__getitem__, jobs.tolist()))
    return StepColumns(values=values, job_ids=job_ids, loss=loss)


def _check_block_values(values: npt.NDArray[np.float64]) -> None:
    bad = ~(values >= 0.0)  # NaN fails too
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise BlockError(NUMERIC[j], f"record {i}: must be a number >= 0, got {values[i, j]}")
    ints = values[:, _INT_COLS]
    bad = (ints != np.floor(ints)) | (ints >= EXACT_LIMIT)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise BlockError(
            INTEGERS[j], f"record {i}: must be a whole number below 2**53, got {ints[i, j]}"
        )
    start, end = values[:, _INDEX["start_s"]], values[:, _INDEX["end_s"]]
    early = end < start
    if early.any():
        i = int(np.argmax(early))
        raise BlockError("end_s", f"record {i}: end_s ({end[i]}) is before start_s ({start[i]})")


def rows(cols: StepColumns) -> list[tuple[Any, ...]]:
    """Field tuples (StepRecord field order, as `msgspec.structs.astuple` gives them) of columns
    that carry their loss; integer fields come back as ints, an unknown loss as None."""
    if cols.loss is None:
        raise ValueError("step columns without their loss cannot be turned back into rows")
    values = cols.values
    loss = cols.loss
    unknown = np.isnan(loss)
    if unknown.any():
        boxed = loss.astype(object)
        boxed[unknown] = None
        loss_list = boxed.tolist()
    else:
        loss_list = loss.tolist()
    by_field: dict[str, list[Any]] = {"job_id": cols.job_ids, "loss": loss_list}
    for name, j in _INDEX.items():
        column = values[:, j]
        by_field[name] = (column.astype(np.int64) if j in _INT_COLS else column).tolist()
    return list(zip(*(by_field[f] for f in FIELDS), strict=True))


def _record_maker() -> Callable[[tuple[Any, ...]], schema.StepRecord]:
    """`row -> StepRecord(job_id=row[0], rank=row[1], ...)`: StepRecord takes keywords only,
    and one generated call is 7x cheaper than building a dict of keywords per record. The
    source is made from StepRecord's own field names, nothing else."""
    keywords = ", ".join(f"{name}=row[{i}]" for i, name in enumerate(FIELDS))
    make: Callable[[tuple[Any, ...]], schema.StepRecord] = eval(
        f"lambda row: record({keywords})", {"record": schema.StepRecord}
    )
    return make


_MAKE_RECORD = _record_maker()


def to_records(cols: StepColumns) -> list[schema.StepRecord]:
    """StepRecords of columns that carry their loss."""
    return list(map(_MAKE_RECORD, rows(cols)))
