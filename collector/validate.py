"""Checks a decoded batch against what the store can hold, before anything is written.

The codec accepts every value the wire schema allows; a store cannot hold NaN in SQLite's NOT NULL
columns, NUL characters in PostgreSQL text, integers past 64 bits, or a rank so large that its
heatmap column would not fit in memory. Each problem becomes a `DecodeError` naming the record
type and field, so the sender gets a 4xx it will not retry. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import numpy.typing as npt

from vigil import columns, schema
from vigil.codec import DecodeError

INT64_MAX = 2**63 - 1
# 262,144 ranks: a hard ceiling above VIGIL_MAX_WORLD_SIZE's largest allowed setting.
MAX_RANK = 2**18 - 1
# Step numbers index the analyzer's float64 columns and the heatmap's rows: exact below 2**53
# (a step counter in nanoseconds reaches it after 104 days). Other integers may use all 63 bits.
MAX_STEP = 2**53 - 1
# StepRecord.loss may be NaN or infinite: a diverged run is evidence, stored as unknown (null).
_NONFINITE_ALLOWED = {("StepRecord", "loss")}


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """Which field positions of one record type get which fast check."""

    floats: tuple[int, ...]  # NaN and inf poison a sum
    ints: tuple[int, ...]  # must fit in 64 bits
    strings: tuple[int, ...]
    rank: int | None
    nested: bool  # optional, list or struct fields: checked record by record

    def __post_init__(self) -> None:
        if not (self.floats or self.ints or self.strings or self.nested):
            raise ValueError("a plan must check at least one field")


def _plan(cls: type[msgspec.Struct]) -> _Plan:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    floats, ints, strings = [], [], []
    nested = False
    for i, f in enumerate(info.fields):
        kind = f.type
        if (cls.__name__, f.name) in _NONFINITE_ALLOWED or isinstance(
            kind, mi.EnumType | mi.BoolType
        ):
            continue
        if isinstance(kind, mi.FloatType):
            floats.append(i)
        elif isinstance(kind, mi.IntType):
            ints.append(i)
        elif isinstance(kind, mi.StrType):
            strings.append(i)
        else:
            nested = True
    rank = cls.__struct_fields__.index("rank") if "rank" in cls.__struct_fields__ else None
    return _Plan(
        floats=tuple(floats), ints=tuple(ints), strings=tuple(strings), rank=rank, nested=nested
    )


_PLANS = {cls: _plan(cls) for cls in schema.RECORD_TYPES}
_astuple = msgspec.structs.astuple


def _column(rows: list[tuple[Any, ...]], positions: tuple[int, ...]) -> Iterable[Any]:
    """Every value at `positions` of every row, flattened (C-level iteration)."""
    if len(positions) == 1:
        return map(itemgetter(positions[0]), rows)
    return chain.from_iterable(map(itemgetter(*positions), rows))


@dataclass(frozen=True, kw_only=True)
class Checked:
    """A batch's records grouped by type (in record order) and the field tuples
    (`msgspec.structs.astuple`) of the groups the store bulk-writes, built once. Step records
    that came as a columnar block alone have no record objects and no tuples yet: their group
    and rows are empty, and `block` (and `steps`) hold them. `verified`: every group
    passed `verify_group`; a `prepare_batch` result is not verified yet, and the store verifies
    each group before it commits (step records while the database digests them)."""

    groups: dict[type, list[Any]]
    rows: dict[type, list[tuple[Any, ...]]]
    steps: columns.StepColumns | None = None
    verified: bool = True
    # The step records of a columnar block, when the batch has no step record objects: their
    # field tuples are not in `rows` (`step_rows` builds them; PostgreSQL's COPY needs none).
    block: columns.StepColumns | None = None

    @property
    def step_count(self) -> int:
        """How many step records the batch holds, block rows included."""
        block = len(self.block) if self.block is not None else 0
        return len(self.rows.get(schema.StepRecord, [])) + block

    @property
    def count(self) -> int:
        """How many records the batch holds, block rows included."""
        others = sum(len(g) for cls, g in self.groups.items() if cls is not schema.StepRecord)
        return others + self.step_count

    def step_rows(self) -> list[tuple[Any, ...]]:
        """Field tuples of every step record of the batch (block rows built on demand)."""
        rows = self.rows.get(schema.StepRecord, [])
        return rows + columns.rows(self.block) if self.block is not None else rows


def group_records(records: Sequence[schema.Record]) -> dict[type, list[Any]]:
    """Records by type, each group in record order (one C-level pass when all share a type)."""
    types = set(map(type, records))
    if len(types) == 1:
        return {types.pop(): list(records)}
    by_type: dict[type, list[Any]] = defaultdict(list)
    for record in records:
        by_type[type(record)].append(record)
    return dict(by_type)


def prepare_batch(
    records: Sequence[schema.Record], block: columns.StepColumns | None = None
) -> Checked:
    """Group and tuple a batch without checking it (see `Checked.verified`); `block`: the
    batch's columnar step records (`codec.decode_frame`), if it had any."""
    groups = group_records(records)
    rows = {
        cls: list(map(_astuple, group))
        for cls, group in groups.items()
        if cls is schema.StepRecord or not _PLANS[cls].nested
    }
    if block is None or not len(block):
        return Checked(groups=groups, rows=rows, verified=False)
    if schema.StepRecord in groups:  # records and a block: one set of rows and columns
        rows[schema.StepRecord] = rows[schema.StepRecord] + columns.rows(block)
        return Checked(groups=groups, rows=rows, verified=False)
    groups[schema.StepRecord] = []
    rows[schema.StepRecord] = []
    return Checked(groups=groups, rows=rows, steps=block, verified=False, block=block)


def verify_group(
    cls: type,
    group: list[Any],
    rows: list[tuple[Any, ...]] | None,
    steps: columns.StepColumns | None = None,
) -> columns.StepColumns | None:
    """Raise DecodeError for the first record of `group` (all of type `cls`; `rows` their
    tuples, if built; `steps` their columns, if built) the store could not hold faithfully;
    step records return their columns."""
    plan = _PLANS[cls]
    if cls is schema.StepRecord:
        if steps is None:
            steps = columns.from_rows(rows if rows is not None else list(map(_astuple, group)))
        if _steps_ok(steps):
            return steps
    elif rows is not None and _fast_ok(plan, rows):
        return None
    # Nested fields, or a fast check that may be a false alarm (a sum overflowing to inf):
    # look at each record and name the first bad field.
    for record in group:
        _check_value(cls.__name__, "", msgspec.structs.asdict(record))
    if steps is not None:  # block rows have no record objects: name the bad cell
        _check_step_columns(steps)
    return steps


def check_batch(
    records: Sequence[schema.Record], block: columns.StepColumns | None = None
) -> Checked:
    """Raise DecodeError for the first record the store could not hold faithfully."""
    prepared = prepare_batch(records, block)
    steps = None
    for cls, group in prepared.groups.items():
        found = verify_group(cls, group, prepared.rows.get(cls), prepared.steps)
        if found is not None:
            steps = found
    return Checked(groups=prepared.groups, rows=prepared.rows, steps=steps, block=prepared.block)


_STEP_FIELDS = schema.StepRecord.__struct_fields__
_STEP_PLAN = _PLANS[schema.StepRecord]
_STEP_FLOATS = [columns.index(_STEP_FIELDS[i]) for i in _STEP_PLAN.floats]
_STEP_INTS = [columns.index(_STEP_FIELDS[i]) for i in _STEP_PLAN.ints]
_STEP_FLOAT_NAMES = [_STEP_FIELDS[i] for i in _STEP_PLAN.floats]
assert [_STEP_FIELDS[i] for i in _STEP_PLAN.strings] == ["job_id"], "step text: job_id only"


def _steps_ok(steps: columns.StepColumns) -> bool:
    """`_fast_ok` for step records, on their columns (float64 comparisons can only raise false
    alarms for integers near the bounds, which the record-by-record pass then settles)."""
    values = steps.values
    if not np.isfinite(values[:, _STEP_FLOATS]).all():
        return False
    ints = values[:, _STEP_INTS]
    if ints.size and (ints.max() >= float(INT64_MAX) or ints.min() <= -float(INT64_MAX)):
        return False
    if steps.column("step").max(initial=0) > MAX_STEP:
        return False
    if steps.column("rank").max(initial=0) > MAX_RANK:
        return False
    return "\x00" not in "".join(steps.job_ids)


def _check_step_columns(steps: columns.StepColumns) -> None:
    """Name the first cell of step columns `_steps_ok` refuses (none: it was a false alarm)."""
    values = steps.values
    for position, name in zip(_STEP_FLOATS, _STEP_FLOAT_NAMES, strict=True):
        bad = np.flatnonzero(~np.isfinite(values[:, position]))
        if bad.size:
            i = int(bad[0])
            problem = f"record {i}: must be a finite number, got {values[i, position]}"
            raise DecodeError("StepRecord", name, problem)
    # Integers need no check here: block rows are whole numbers below 2**53 (`columns`), and
    # record rows were checked exactly, record by record, before (a float64 comparison would
    # refuse 2**63 - 1, which fits).
    ranks = np.flatnonzero(steps.column("rank") > MAX_RANK)
    if ranks.size:
        i = int(ranks[0])
        raise DecodeError(
            "StepRecord",
            "rank",
            f"record {i}: rank {int(steps.column('rank')[i])} exceeds the collector's limit "
            f"of {MAX_RANK}",
        )
    for i, job in enumerate(steps.job_ids):
        if "\x00" in job:
            problem = f"record {i}: must not contain NUL characters"
            raise DecodeError("StepRecord", "job_id", problem)


def check_envelope(batch: schema.Batch) -> None:
    """Raise DecodeError when the batch's own fields cannot be stored (NUL characters)."""
    for field in ("batch_id", "source"):
        if "\x00" in getattr(batch, field):
            raise DecodeError("Batch", field, "must not contain NUL characters")


# Record types whose `rank` is a rank of their job (Sample's -1 means "no rank").
_RANKED = (
    schema.StepRecord,
    schema.CollectiveAggregate,
    schema.CollectiveEvent,
    schema.Heartbeat,
    schema.RankInfo,
    schema.Sample,
)


def declared_world_sizes(checked: Checked) -> dict[str, int]:
    """World sizes a batch declares itself: its Job records, else its ranks' RankInfo."""
    declared: dict[str, int] = {}
    for info in checked.groups.get(schema.RankInfo, ()):
        if info.world_size:
            declared[info.job_id] = max(declared.get(info.job_id, 0), info.world_size)
    for job in checked.groups.get(schema.Job, ()):
        declared[job.job_id] = job.world_size
    return declared


def ranked_jobs(checked: Checked) -> set[str]:
    """The jobs a batch's ranked records (and its step block) belong to."""
    jobs = checked.block.jobs() if checked.block is not None else set()
    for cls in _RANKED:
        jobs.update(map(_JOB_ID, checked.groups.get(cls, ())))
    return jobs


def check_world(checked: Checked, world_sizes: dict[str, int], max_world_size: int) -> None:
    """Raise DecodeError for a declared world size above `max_world_size`, or a rank at or past
    its job's world size (`world_sizes`; jobs not in it: past `max_world_size`). Ranks tied
    to the job keep storage and analysis proportional to ranks that exist."""
    for declaring in (schema.Job, schema.RankInfo):
        for i, record in enumerate(checked.groups.get(declaring, ())):
            if record.world_size > max_world_size:
                raise DecodeError(
                    declaring.__name__,
                    "world_size",
                    f"record {i}: world size {record.world_size} exceeds the collector's limit "
                    f"of {max_world_size} (VIGIL_MAX_WORLD_SIZE)",
                )
    for cls in _RANKED:
        if cls is schema.StepRecord:
            continue
        for i, record in enumerate(checked.groups.get(cls, ())):
            job = record.job_id
            world = world_sizes.get(job, max_world_size)
            if record.rank >= world:
                problem = _past_world(i, record.rank, job, world, job in world_sizes)
                raise DecodeError(cls.__name__, "rank", problem)
    if checked.block is not None:
        block = checked.block
        _check_step_ranks(block.column("rank"), block.job_ids, world_sizes, max_world_size)
    rows = checked.rows.get(schema.StepRecord)
    if rows:  # step records that came as records (their rows include any block's)
        ranks = np.fromiter(map(itemgetter(_STEP_RANK), rows), dtype=np.float64, count=len(rows))
        jobs = list(map(itemgetter(_STEP_JOB), rows))
        _check_step_ranks(ranks, jobs, world_sizes, max_world_size)


_JOB_ID = attrgetter("job_id")
_STEP_RANK = schema.StepRecord.__struct_fields__.index("rank")
_STEP_JOB = schema.StepRecord.__struct_fields__.index("job_id")


def _check_step_ranks(
    ranks: npt.NDArray[np.float64],
    job_ids: list[str],
    world_sizes: dict[str, int],
    max_world_size: int,
) -> None:
    jobs = set(job_ids)
    if len(jobs) == 1:
        limit = np.full(len(ranks), world_sizes.get(jobs.pop(), max_world_size), dtype=float)
    else:
        limit = np.fromiter(
            (world_sizes.get(j, max_world_size) for j in job_ids), float, len(job_ids)
        )
    past = np.flatnonzero(ranks >= limit)
    if past.size:
        i = int(past[0])
        job = job_ids[i]
        problem = _past_world(i, int(ranks[i]), job, int(limit[i]), job in world_sizes)
        raise DecodeError("StepRecord", "rank", problem)


def _past_world(i: int, rank: int, job: str, world: int, declared: bool) -> str:
    why = f"job {job!r} declared" if declared else f"no declared size for job {job!r}: the limit"
    return f"record {i}: rank {rank} is not below world size {world} ({why})"


def _fast_ok(plan: _Plan, rows: list[tuple[Any, ...]]) -> bool:
    """A few C-level passes over a whole group's field tuples; False means "look record by
    record" (it may be a false alarm, e.g. a huge but valid float)."""
    if plan.floats and not math.isfinite(sum(_column(rows, plan.floats))):
        return False
    if plan.ints:
        values = list(_column(rows, plan.ints))
        if max(values) > INT64_MAX or min(values) < -INT64_MAX:
            return False
    if plan.rank is not None and max(map(itemgetter(plan.rank), rows)) > MAX_RANK:
        return False
    return not plan.strings or "\x00" not in "".join(_column(rows, plan.strings))


def _check_value(record_type: str, field: str, value: Any) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _check_value(record_type, f"{field}.{key}" if field else str(key), item)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_value(record_type, f"{field}[{i}]", item)
    elif isinstance(value, msgspec.Struct):
        _check_value(record_type, field, msgspec.structs.asdict(value))
    else:
        problem = _problem(record_type, field, value)
        if problem:
            raise DecodeError(record_type, field, problem)


def _problem(record_type: str, field: str, value: object) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        if not math.isfinite(value) and (record_type, field) not in _NONFINITE_ALLOWED:
            return f"must be a finite number, got {value}"
    elif isinstance(value, int):
        if abs(value) > INT64_MAX:
            return f"{value} does not fit in a signed 64-bit integer"
        if record_type == "StepRecord" and field == "step" and value > MAX_STEP:
            return (
                f"step {value} is past the largest step vigil keeps exact ({MAX_STEP}, 2**53 - 1)"
            )
        if field == "rank" and value > MAX_RANK:
            return f"rank {value} exceeds the collector's limit of {MAX_RANK}"
    elif isinstance(value, str) and "\x00" in value:
        return "must not contain NUL characters"
    return None
