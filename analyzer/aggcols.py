"""A streaming batch split by record type, its aggregates and heartbeats as arrays, and one
window row's attribution.

The streaming analyzer reads tens of thousands of aggregates and heartbeats per step at 10,000
ranks; a Python-level pass per record per consumer costs tens of milliseconds. `split` sorts a
batch by type in one pass; `agg_batch` and
`beat_batch` pull the fields every consumer needs in one C-level pass (`attrgetter` into
`np.fromiter`), `AggBatch.columns` gives `attribution.AggColumns` without a second pass, and
`attribute_row` attributes one window row as `attribution.attribute` does, with dense integer
cells in place of `np.unique` over rows (the same numbers: tests compare the two), falling back to
`attribution.attribute` whenever members of a cell disagree on the ops they ran. Pure numpy; must
not change what attribution means (that lives in `attribution`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import attribution

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
# One field of every record per pass: `np.fromiter` over `attrgetter` is the cheapest way
# numpy offers to read a field of many Python objects (a pass of many fields at once, or a
# tuple per record, costs more).
_GET = {
    name: attrgetter(name)
    for name in (
        "rank", "step", "count", "last_seq", "total_device_s", "last_device_s", "overlapped",
        "bytes", "group", "op", "time_s", "checkpoints", "last_group", "last_op", "state",
        "between_steps", "compiling",
    )
}  # fmt: skip


# The record types besides steps, aggregates and heartbeats the streaming analyzer reads.
OTHERS = frozenset({schema.Sample, schema.Job, schema.RankInfo, schema.Action})


def split(
    batch: Sequence[schema.Record],
) -> tuple[
    list[schema.StepRecord],
    list[schema.CollectiveAggregate],
    list[schema.Heartbeat],
    list[schema.Record],
]:
    """A batch's step records, aggregates, heartbeats and the other records the analyzer
    reads, each in batch order (one pass: the cheapest split of an interleaved batch)."""
    steps: list[Any] = []
    aggs: list[Any] = []
    beats: list[Any] = []
    others: list[Any] = []
    lists = {schema.StepRecord: steps, schema.CollectiveAggregate: aggs, schema.Heartbeat: beats}
    lists.update(dict.fromkeys(OTHERS, others))
    get = lists.get
    for r in batch:
        part = get(type(r))
        if part is not None:
            part.append(r)
    return steps, aggs, beats, others


def distinct(values: I64) -> I64:
    """The sorted distinct values of non-negative integers (`np.unique`; by counting when
    they span a small range, as a batch's steps and ranks do, which is ~30x cheaper)."""
    if not values.size:
        return values
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi - lo > 4 * values.size + 4096:
        return np.unique(values)
    found: I64 = np.flatnonzero(np.bincount(values - lo)) + lo
    return found


def repeats(values: I64) -> bool:
    """Whether some value occurs twice (non-negative integers)."""
    return bool(distinct(values).size != values.size)


def occurrence(values: I64) -> I64:
    """For each element, how many equal ones come before it (0 for a value's first)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    runs = np.diff(np.r_[starts, ordered.size])
    nth = np.empty_like(values)
    nth[order] = np.arange(values.size) - np.repeat(starts, runs)
    return nth


def _ints(records: Sequence[object], name: str) -> I64:
    return np.fromiter(map(_GET[name], records), np.int64, len(records))


def _floats(records: Sequence[object], name: str) -> F64:
    return np.fromiter(map(_GET[name], records), np.float64, len(records))


@dataclass(kw_only=True)
class AggBatch:
    """Aggregates as arrays, in batch order: `group` indexes `groups`, `key` the caller's
    (group, op class) keys."""

    rank: I64
    step: I64
    group: I64
    key: I64
    count: I64
    last_seq: I64
    total_s: F64
    last_s: F64
    overlapped: npt.NDArray[np.bool_]
    nbytes: I64

    def __len__(self) -> int:
        return int(self.rank.size)

    def take(self, mask: npt.NDArray[np.bool_]) -> AggBatch:
        return AggBatch(**{name: getattr(self, name)[mask] for name in _BATCH_FIELDS})

    def columns(self, row: I64, col: I64) -> attribution.AggColumns:
        """As attribution's columns, at grid cells (`row`, `col`) per aggregate."""
        return attribution.AggColumns(
            row=row, col=col, key=self.key, count=self.count, last_seq=self.last_seq,
            total_s=self.total_s, last_s=self.last_s, overlapped=self.overlapped,
            nbytes=self.nbytes,
        )  # fmt: skip


_BATCH_FIELDS = (
    "rank", "step", "group", "key", "count", "last_seq", "total_s", "last_s", "overlapped",
    "nbytes",
)  # fmt: skip


class Names:
    """Ids of group names and of (group, op class) keys, grown as new ones appear; `keys` is
    the window's dict (key ids in order of first appearance, as `attribution.columns_of`)."""

    def __init__(self, keys: dict[tuple[str, str], int]) -> None:
        self.keys = keys
        self.groups: dict[str, int] = {}
        self.group_names: list[str] = []
        self._ops: dict[str, int] = {}
        # [group id, op id] -> key id (-1: not seen yet)
        self._table = np.full((0, 0), -1, dtype=np.int64)
        self._last: tuple[list[str], list[str], I64, I64] | None = None  # the last `ids` call

    def group_id(self, group: str) -> int:
        gid = self.groups.get(group)
        if gid is None:
            gid = self.groups[group] = len(self.group_names)
            self.group_names.append(group)
        return gid

    def group_ids(self, groups: list[str]) -> I64:
        lookup = self.groups
        found = list(map(lookup.get, groups))
        if None in found:
            found = [
                self.group_id(g) if i is None else i for g, i in zip(groups, found, strict=True)
            ]
        return np.fromiter(found, np.int64, len(found))

    def ids(self, groups: list[str], ops: list[str]) -> tuple[I64, I64]:
        """(group ids, key ids) of aggregates' groups and ops; new keys are numbered in order
        of first appearance. A sender's batches list the same groups and ops step after step:
        the previous batch's ids are reused when its names were the same."""
        last = self._last
        if last is not None and last[0] == groups and last[1] == ops:
            return last[2], last[3]
        gid, key = self._ids(groups, ops)
        self._last = (groups, ops, gid, key)
        return gid, key

    def _ids(self, groups: list[str], ops: list[str]) -> tuple[I64, I64]:
        gid = self.group_ids(groups)
        found = list(map(self._ops.get, ops))
        if None in found:
            found = [self._op_id(o) if i is None else i for o, i in zip(ops, found, strict=True)]
        oid = np.fromiter(found, np.int64, len(found))
        if gid.size and (
            int(gid.max()) >= self._table.shape[0] or int(oid.max()) >= self._table.shape[1]
        ):
            shape = (len(self.group_names), len(self._ops))
            table = np.full(shape, -1, dtype=np.int64)
            table[: self._table.shape[0], : self._table.shape[1]] = self._table
            self._table = table
        key = self._table[gid, oid]
        for i in np.flatnonzero(key < 0).tolist():  # new (group, op class) pairs, in order
            g, o = int(gid[i]), int(oid[i])
            if self._table[g, o] < 0:
                k = (groups[i], attribution.op_class(ops[i]))
                self._table[g, o] = self.keys.setdefault(k, len(self.keys))
            key[i] = self._table[g, o]
        return gid, key

    def _op_id(self, op: str) -> int:
        return self._ops.setdefault(op, len(self._ops))


def agg_batch(aggs: Sequence[schema.CollectiveAggregate], names: Names) -> AggBatch:
    """One pass per field over `aggs`."""
    group, key = names.ids(list(map(_GET["group"], aggs)), list(map(_GET["op"], aggs)))
    count, total, last = (
        _ints(aggs, "count"),
        _floats(aggs, "total_device_s"),
        _floats(aggs, "last_device_s"),
    )
    return AggBatch(
        rank=_ints(aggs, "rank"), step=_ints(aggs, "step"), group=group, key=key, count=count,
        last_seq=_ints(aggs, "last_seq"), total_s=total,
        # Senders older than the field shipped 0: with one op the last is the total.
        last_s=np.where((last > 0) | (count != 1), last, total),
        overlapped=np.fromiter(map(_GET["overlapped"], aggs), bool, len(aggs)),
        nbytes=_ints(aggs, "bytes") // np.maximum(count, 1),
    )  # fmt: skip


# Heartbeat states as small integers (`BeatBatch.state_code`).
STATE_CODES = {state: i for i, state in enumerate(schema.RankState)}


@dataclass(kw_only=True)
class BeatBatch:
    """Heartbeats as arrays, in batch order (`group`: -1 for none); `records` the heartbeats,
    `at` each one's position there (their ops are read only for the ranks that wait)."""

    rank: I64
    time_s: F64
    seq: I64
    checkpoints: I64
    group: I64
    state_code: I64
    between: npt.NDArray[np.bool_]  # between steps (`Heartbeat.between_steps`)
    compiling: npt.NDArray[np.bool_]  # `Heartbeat.compiling`
    records: Sequence[schema.Heartbeat]
    at: I64

    def __len__(self) -> int:
        return int(self.rank.size)

    def take(self, mask: npt.NDArray[np.bool_]) -> BeatBatch:
        arrays = {name: getattr(self, name)[mask] for name in _BEAT_ARRAYS}
        return BeatBatch(**arrays, records=self.records)

    def ops(self, index: I64) -> list[str]:
        records = self.records
        return [records[i].last_op for i in self.at[index].tolist()]


_BEAT_ARRAYS = (
    "rank", "time_s", "seq", "checkpoints", "group", "state_code", "between", "compiling", "at",
)  # fmt: skip


def beat_batch(beats: Sequence[schema.Heartbeat], names: Names) -> BeatBatch:
    """One pass per field over `beats`."""
    gid = names.group_ids(list(map(_GET["last_group"], beats)))
    if "" in names.groups:
        gid[gid == names.groups[""]] = -1
    states = map(STATE_CODES.__getitem__, map(_GET["state"], beats))
    return BeatBatch(
        rank=_ints(beats, "rank"), time_s=_floats(beats, "time_s"), seq=_ints(beats, "last_seq"),
        checkpoints=_ints(beats, "checkpoints"), group=gid,
        state_code=np.fromiter(states, np.int64, len(beats)),
        between=np.fromiter(map(_GET["between_steps"], beats), bool, len(beats)),
        compiling=np.fromiter(map(_GET["compiling"], beats), bool, len(beats)), records=beats,
        at=np.arange(len(beats), dtype=np.int64),
    )  # fmt: skip


def attribute_row(c: attribution.AggColumns, width: int) -> attribution.Attribution:
    """`attribution.attribute(c, (1, width))` for aggregates of one row (`c.row` all zero)."""
    if not len(c):
        return attribution.attribute(c, (1, width))
    num_keys = int(c.key.max()) + 1
    present = np.bincount(c.key, minlength=num_keys) > 0
    index = np.cumsum(present) - 1  # key -> cell, in key order (as np.unique numbers them)
    inv = index[c.key]
    groups = int(index[-1]) + 1
    first = np.full(groups, c.key.size, dtype=np.int64)
    np.minimum.at(first, inv, np.arange(c.key.size, dtype=np.int64))
    lead = first[inv]
    if not (
        np.array_equal(c.last_seq, c.last_seq[lead]) and np.array_equal(c.count, c.count[lead])
    ):
        return attribution.attribute(c, (1, width))  # members disagree: the general rule
    # Every member of a cell agrees: each cell's agreeing set is all of it.
    ok = np.bincount(inv, minlength=groups)[inv] >= 2
    shape = (1, width)
    wait = np.zeros(width, dtype=np.float64)
    hidden = np.zeros(width, dtype=np.float64)
    transfer = np.zeros(width, dtype=np.float64)
    seen = np.zeros(width, dtype=bool)
    if ok.any():
        min_total = np.full(groups, np.inf)
        min_last = np.full(groups, np.inf)
        np.minimum.at(min_total, inv[ok], c.total_s[ok])
        np.minimum.at(min_last, inv[ok], c.last_s[ok])
        i = inv[ok]
        over = c.overlapped[ok]
        x = np.where(over, min_total[i], np.minimum(min_total[i], c.count[ok] * min_last[i]))
        w = np.where(over, c.last_s[ok] - min_last[i], c.total_s[ok] - x).clip(min=0.0)
        col = c.col[ok]
        wait += np.bincount(col, weights=w, minlength=width)
        hidden += np.bincount(col, weights=np.where(over, w, 0.0), minlength=width)
        transfer += np.bincount(col, weights=x, minlength=width)
        seen[col] = True

    def out(values: F64) -> npt.NDArray[np.float32]:
        result = np.full(shape, np.nan, dtype=np.float32)
        result[0, seen] = values[seen]
        return result

    return attribution.Attribution(
        wait_s=out(wait), hidden_wait_s=out(hidden), transfer_s=out(transfer)
    )
