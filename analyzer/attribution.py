"""Cross-rank wait attribution: who waited for whom, from the durations every member reported.

In synchronous training a collective ends at nearly the same instant on every member, so for one
op the difference between a member's duration and the shortest member's is that member's wait
for the last arrival, and the shortest member arrived last. No clock alignment is needed, and
unlike a rank's own history this tells a persistent straggler's lateness from transfer time.

The SDK ships per (step, rank, group, op) an aggregate: count, total duration, the last op's
duration and sequence number, and whether the ops were `overlapped` (run behind compute and
waited for where the SDK cannot see, as DDP's gradient buckets are). Per (step, group, op) over
the members that reported the same ops (the `last_seq` and `count` most of them share, at least
two members):

- not overlapped (each op is waited for as it ends, so the waits add up):
  wait_r = total_r - transfer (below);
- overlapped (the thread waits once, for the last op, at the end of backward; the earlier ones
  overlap compute): wait_r = last_r - min_m last_m;
- transfer, the same for every member: the ops' time with nobody waited for. Per op it is the
  shortest member's duration (the last arrival waits nothing), but the aggregate sums a step's
  ops, and when a different member arrives last at each op (per-layer jitter) the shortest
  total still holds waits: min_m total_m is only an upper bound. The last op is seen alone
  (`last_device_s`), so min_m last_m is exactly that op's transfer; for ops that are waited for
  one by one (not overlapped: a layer's tensor-parallel collectives, same bytes each) the
  estimate is min(min_m total_m, count x min_m last_m). Overlapped ops (DDP's buckets) differ
  in size and queue behind each other, so they keep the upper bound.

Point-to-point ops of one pair share their group's sequence numbers, so sends and receives are
one class (`p2p`): the receiver's extra time is its wait for the sender.

Per (step, rank) the results add over the rank's (group, op): `wait_s` (all of it),
`hidden_wait_s` (the overlapped part, which the SDK's `comm_wait_s` cannot contain) and
`transfer_s`. Cells without an attributable aggregate are NaN. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vigil import schema

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

_P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


def op_class(op: str) -> str:
    """The class an op is matched in across members (sends and receives of a pair are one)."""
    return "p2p" if op in _P2P_OPS else op


@dataclass(kw_only=True)
class Attribution:
    """Per (step, rank): time waiting for the last arrival, the part of it the SDK cannot see,
    and the collectives' own transfer time; NaN where nothing could be attributed."""

    wait_s: F32
    hidden_wait_s: F32
    transfer_s: F32


@dataclass(kw_only=True)
class AggColumns:
    """Collective aggregates as columns: row and column indices into a [steps, ranks] grid, the
    (group, op class) key each belongs to, and the fields attribution reads."""

    row: I64
    col: I64
    key: I64
    count: I64
    last_seq: I64
    total_s: F64
    last_s: F64
    overlapped: npt.NDArray[np.bool_]
    nbytes: I64  # bytes moved per op (the aggregate's bytes over its count)

    @classmethod
    def empty(cls) -> AggColumns:
        i, f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return cls(
            row=i, col=i, key=i, count=i, last_seq=i, total_s=f, last_s=f,
            overlapped=np.zeros(0, dtype=bool), nbytes=i,
        )  # fmt: skip

    def take(self, mask: npt.NDArray[np.bool_]) -> AggColumns:
        return AggColumns(**{name: getattr(self, name)[mask] for name in _FIELDS})

    @classmethod
    def concat(cls, parts: Sequence[AggColumns]) -> AggColumns:
        if not parts:
            return cls.empty()
        return cls(**{name: np.concatenate([getattr(p, name) for p in parts]) for name in _FIELDS})

    def __len__(self) -> int:
        return int(self.row.size)


def columns_of(
    aggs: Sequence[schema.CollectiveAggregate],
    row_of: dict[int, int],
    col_of: dict[int, int],
    keys: dict[tuple[str, str], int],
) -> AggColumns:
    """Aggregates whose step and rank are in `row_of` / `col_of` as columns; `keys` maps
    (group, op class) to an index and grows with new ones."""
    picked = [a for a in aggs if a.step in row_of and a.rank in col_of]
    if not picked:
        return AggColumns.empty()
    key_ids = []
    for a in picked:
        k = (a.group, op_class(a.op))
        index = keys.get(k)
        if index is None:
            index = keys[k] = len(keys)
        key_ids.append(index)
    return AggColumns(
        row=np.fromiter((row_of[a.step] for a in picked), np.int64, len(picked)),
        col=np.fromiter((col_of[a.rank] for a in picked), np.int64, len(picked)),
        key=np.asarray(key_ids, dtype=np.int64),
        count=np.fromiter((a.count for a in picked), np.int64, len(picked)),
        last_seq=np.fromiter((a.last_seq for a in picked), np.int64, len(picked)),
        total_s=np.fromiter((a.total_device_s for a in picked), np.float64, len(picked)),
        last_s=np.fromiter((_last(a) for a in picked), np.float64, len(picked)),
        overlapped=np.fromiter((a.overlapped for a in picked), bool, len(picked)),
        nbytes=np.fromiter((a.bytes // max(a.count, 1) for a in picked), np.int64, len(picked)),
    )


_FIELDS = (
    "row", "col", "key", "count", "last_seq", "total_s", "last_s", "overlapped", "nbytes",
)  # fmt: skip


def _last(a: schema.CollectiveAggregate) -> float:
    # Senders older than the field shipped 0: with one op the last is the total.
    if a.last_device_s > 0 or a.count != 1:
        return a.last_device_s
    return a.total_device_s


def comparable(c: AggColumns) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_], int]:
    """Per aggregate: the index of its (row, key) cell, whether it is compared within that cell
    (it agrees with most members on `last_seq` and `count`, and at least two do), and the
    number of cells.

    Cells are numbered densely in (row, key) order, as `np.unique` numbers them. Where every
    member of a cell agrees (nearly all of them), the agreeing set is the whole cell; only the
    aggregates of cells whose members disagree go through the general rule
    (`comparable_general`, the same result: tests compare the two)."""
    if not len(c):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), 0
    num_keys = int(c.key.max()) + 1
    flat = c.row * num_keys + c.key
    span = int(flat.max()) + 1
    if int(flat.min()) < 0 or span > 4 * flat.size + 4096:
        return comparable_general(c)  # cells too sparse to number by counting
    present = np.bincount(flat, minlength=span) > 0
    index = np.cumsum(present) - 1  # cell value -> its rank among the present ones
    inv: I64 = index[flat]
    groups = int(index[-1]) + 1
    lead = np.full(groups, flat.size, dtype=np.int64)
    np.minimum.at(lead, inv, np.arange(flat.size, dtype=np.int64))
    at = lead[inv]
    agrees = (c.last_seq == c.last_seq[at]) & (c.count == c.count[at])
    ok = np.bincount(inv, minlength=groups)[inv] >= 2
    if not agrees.all():
        split = np.zeros(groups, dtype=bool)
        split[inv[~agrees]] = True  # cells whose members disagree
        mixed = split[inv]
        ok[mixed] = comparable_general(c.take(mixed))[1]
    return inv, ok, groups


def comparable_general(
    c: AggColumns,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_], int]:
    """`comparable` by its general rule: per cell, the largest set of members agreeing on
    (`last_seq`, `count`) (ties: the smallest pair) is compared, if it has two members."""
    if not len(c):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), 0
    num_keys = int(c.key.max()) + 1
    _, inv = np.unique(c.row * num_keys + c.key, return_inverse=True)
    inv = inv.astype(np.int64).reshape(-1)
    groups = int(inv.max()) + 1
    combos = np.stack([inv, c.last_seq, c.count], axis=1)
    kinds, which, sizes = np.unique(combos, axis=0, return_inverse=True, return_counts=True)
    which = which.reshape(-1)
    order = np.lexsort((-sizes, kinds[:, 0]))  # per cell, its largest agreeing set first
    first = np.ones(order.size, dtype=bool)
    first[1:] = kinds[order[1:], 0] != kinds[order[:-1], 0]
    chosen = np.zeros(kinds.shape[0], dtype=bool)
    chosen[order[first]] = True
    ok = chosen[which]
    members = np.bincount(inv[ok], minlength=groups)
    ok &= members[inv] >= 2
    return inv, ok, groups


def attribute(c: AggColumns, shape: tuple[int, int]) -> Attribution:
    """Attribute waits and transfer time over a [steps, ranks] grid; see the module docstring."""
    wait = np.zeros(shape, dtype=np.float64)
    hidden = np.zeros(shape, dtype=np.float64)
    transfer = np.zeros(shape, dtype=np.float64)
    seen = np.zeros(shape, dtype=bool)
    if len(c):
        inv, ok, groups = comparable(c)
        min_total, min_last = _cell_minima(c, inv, ok, groups)
        i = inv[ok]
        x = _transfer(c, ok, min_total, min_last, i)
        w = np.where(c.overlapped[ok], c.last_s[ok] - min_last[i], c.total_s[ok] - x).clip(min=0.0)
        at = (c.row[ok], c.col[ok])
        np.add.at(wait, at, w)
        np.add.at(hidden, at, np.where(c.overlapped[ok], w, 0.0))
        np.add.at(transfer, at, x)
        seen[at] = True

    def out(values: F64) -> F32:
        result = np.full(shape, np.nan, dtype=np.float32)
        result[seen] = values[seen]
        return result

    return Attribution(wait_s=out(wait), hidden_wait_s=out(hidden), transfer_s=out(transfer))


def _cell_minima(
    c: AggColumns, inv: I64, ok: npt.NDArray[np.bool_], groups: int
) -> tuple[F64, F64]:
    """Per cell, the shortest compared `total_s` and `last_s` (inf where none is compared).
    By a stable sort and `reduceat`: aggregates come nearly sorted by cell, and
    `np.minimum.at` is ~20x slower on these durations (exact zeros among them)."""
    cell = inv[ok]
    order = np.argsort(cell, kind="stable")
    cell = cell[order]
    starts = np.flatnonzero(np.concatenate(([True], cell[1:] != cell[:-1])))
    min_total = np.full(groups, np.inf)
    min_last = np.full(groups, np.inf)
    if cell.size:
        at = cell[starts]
        min_total[at] = np.minimum.reduceat(c.total_s[ok][order], starts)
        min_last[at] = np.minimum.reduceat(c.last_s[ok][order], starts)
    return min_total, min_last


def _transfer(
    c: AggColumns, ok: npt.NDArray[np.bool_], min_total: F64, min_last: F64, cell: I64
) -> F64:
    """Per compared aggregate, its cell's transfer estimate (see the module docstring)."""
    per_op: F64 = np.where(
        c.overlapped[ok],
        min_total[cell],
        np.minimum(min_total[cell], c.count[ok] * min_last[cell]),
    )
    return per_op


@dataclass(kw_only=True)
class GroupTransfer:
    """Per (row, key) cell with comparable members: its transfer time (as `attribute`
    estimates it) and bytes per op; `member_cell` and `member_col` give, per compared
    aggregate, its cell (an index into these arrays) and column (`members` lists them)."""

    row: I64
    key: I64
    transfer_s: F64
    nbytes: I64
    member_cell: I64
    member_col: I64

    @classmethod
    def empty(cls) -> GroupTransfer:
        i = np.zeros(0, dtype=np.int64)
        return cls(row=i, key=i, transfer_s=np.zeros(0), nbytes=i, member_cell=i, member_col=i)

    @classmethod
    def concat(cls, parts: Sequence[GroupTransfer], rows: Sequence[int]) -> GroupTransfer:
        """Parts of one row each (as `group_transfer` gives them for a row's aggregates),
        placed at `rows`: what `group_transfer` gives for all their aggregates at once, since
        cells never span rows (in `rows` ascending, the same cells in the same order)."""
        if not parts:
            return cls.empty()
        sizes = np.asarray([p.row.size for p in parts], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        return cls(
            row=np.repeat(np.asarray(rows, dtype=np.int64), sizes),
            key=np.concatenate([p.key for p in parts]),
            transfer_s=np.concatenate([p.transfer_s for p in parts]),
            nbytes=np.concatenate([p.nbytes for p in parts]),
            member_cell=np.concatenate(
                [p.member_cell + o for p, o in zip(parts, offsets.tolist(), strict=True)]
            ),
            member_col=np.concatenate([p.member_col for p in parts]),
        )

    def members(self, cells: Sequence[int]) -> list[tuple[int, ...]]:
        """The member columns of each of `cells`, sorted (a column once per aggregate it has
        there: a rank that both sends and receives in a pair's cell is listed twice)."""
        want = np.zeros(self.row.size, dtype=bool)
        want[np.asarray(cells, dtype=np.int64)] = True
        picked = want[self.member_cell]
        cell, col = self.member_cell[picked], self.member_col[picked]
        order = np.lexsort((col, cell))
        cell, col = cell[order], col[order]
        bounds = np.flatnonzero(np.diff(cell)) + 1
        found = {
            int(part_cell[0]): tuple(part.tolist())
            for part_cell, part in zip(np.split(cell, bounds), np.split(col, bounds), strict=True)
            if part.size
        }
        return [found.get(int(i), ()) for i in cells]


def group_transfer(c: AggColumns) -> GroupTransfer:
    inv, ok, groups = comparable(c)
    if not ok.any():
        return GroupTransfer.empty()
    present = np.zeros(groups, dtype=bool)
    present[inv[ok]] = True
    cells = np.flatnonzero(present)
    index = np.full(groups, -1, dtype=np.int64)
    index[cells] = np.arange(cells.size)
    at = index[inv[ok]]
    min_total, min_last = _cell_minima(c, inv, ok, groups)
    transfer = np.zeros(cells.size)
    transfer[at] = _transfer(c, ok, min_total, min_last, inv[ok])
    row = np.zeros(cells.size, dtype=np.int64)
    key = np.zeros(cells.size, dtype=np.int64)
    nbytes = np.zeros(cells.size, dtype=np.int64)
    row[at], key[at], nbytes[at] = c.row[ok], c.key[ok], c.nbytes[ok]
    return GroupTransfer(
        row=row, key=key, transfer_s=transfer, nbytes=nbytes, member_cell=at,
        member_col=c.col[ok],
    )  # fmt: skip
