"""Where each rank is in each process group: `seqs[group][rank]`, updated a batch at a time.

`hangs.HangTracker` keeps the last sequence number each rank entered per group. At 10,000 ranks
a streaming step brings tens of thousands of positions (aggregates, heartbeats); a dict of dicts
updated record by record costs tens of milliseconds. `Positions` keeps them as numpy arrays
keyed by an integer code (group id << 40 | rank), sorted for `searchsorted`, and updates them in
bulk (`raise_to`: a finished step's aggregates, which never move a rank back; `set_to`:
heartbeats, where the rank is now); single updates (`raise_one`, `set_one`) wait in a small
overlay until the next bulk one. `seqs()` builds the mapping `waitgraph` reads only when asked,
with groups and members in the order record-by-record dict updates would give (first
appearance). Pure; no I/O.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from vigil.analyzer import aggcols

I64 = npt.NDArray[np.int64]
_SHIFT = 40
_MASK = (1 << _SHIFT) - 1


class Positions:
    """`seqs[group][rank]` for one job; see the module docstring."""

    def __init__(self, names: aggcols.Names) -> None:
        self.names = names
        self.clear()

    def clear(self) -> None:
        self._codes = np.zeros(0, dtype=np.int64)  # sorted
        self._seqs = np.zeros(0, dtype=np.int64)
        self._order = np.zeros(0, dtype=np.int64)  # when each code first appeared
        self._next = 0
        self._overlay: dict[int, int] = {}  # single updates not merged yet
        self._view: dict[str, dict[int, int]] | None = None

    # --- one at a time ----------------------------------------------------------------------
    def _code(self, group: str, rank: int) -> int:
        if not 0 <= rank <= _MASK:
            raise ValueError(f"rank {rank} out of range (0..{_MASK})")
        return (self.names.group_id(group) << _SHIFT) | rank

    def _get(self, code: int) -> int | None:
        seq = self._overlay.get(code)
        if seq is not None:
            return seq
        i = int(np.searchsorted(self._codes, code))
        if i < self._codes.size and int(self._codes[i]) == code:
            return int(self._seqs[i])
        return None

    def raise_one(self, group: str, rank: int, seq: int) -> None:
        """`rank` entered `seq` in `group`, unless it is known further on."""
        code = self._code(group, rank)
        known = self._get(code)
        if seq >= (-1 if known is None else known):
            self._overlay[code] = seq
            self._view = None

    def set_one(self, group: str, rank: int, seq: int) -> None:
        """`rank` is at `seq` in `group` now (lower wins too: a restarted rank starts over)."""
        self._overlay[self._code(group, rank)] = seq
        self._view = None

    # --- in bulk ------------------------------------------------------------------------------
    def _codes_of(self, group: I64, rank: I64) -> I64:
        if rank.size and (int(rank.min()) < 0 or int(rank.max()) > _MASK):
            raise ValueError(f"rank out of range (0..{_MASK})")
        codes: I64 = (group << _SHIFT) | rank
        return codes

    def _find(self, codes: I64) -> tuple[I64, npt.NDArray[np.bool_]]:
        at = np.searchsorted(self._codes, codes)
        found = at < self._codes.size
        found[found] = self._codes[at[found]] == codes[found]
        return at, found

    def _flush(self) -> None:
        if self._overlay:
            codes = np.fromiter(self._overlay.keys(), np.int64, len(self._overlay))
            seqs = np.fromiter(self._overlay.values(), np.int64, len(self._overlay))
            self._overlay.clear()
            self._assign(codes, seqs)

    def _assign(self, codes: I64, seqs: I64) -> None:
        """Set distinct `codes` (new ones appear in the order given)."""
        at, found = self._find(codes)
        self._seqs[at[found]] = seqs[found]
        if not found.all():
            self._insert(codes[~found], seqs[~found])

    def _insert(self, codes: I64, seqs: I64) -> None:
        """Add distinct new `codes`, first appearing in the order given."""
        order = np.arange(self._next, self._next + codes.size, dtype=np.int64)
        self._next += codes.size
        all_codes = np.concatenate([self._codes, codes])
        sort = np.argsort(all_codes, kind="stable")
        self._codes = all_codes[sort]
        self._seqs = np.concatenate([self._seqs, seqs])[sort]
        self._order = np.concatenate([self._order, order])[sort]

    def raise_to(self, group: I64, rank: I64, seq: I64) -> None:
        """`raise_one` for each (group id, rank, seq), in order."""
        if not rank.size:
            return
        self._flush()
        self._view = None
        codes = self._codes_of(group, rank)
        at, found = self._find(codes)
        np.maximum.at(self._seqs, at[found], seq[found])
        if found.all():
            return
        new, first, inv = np.unique(codes[~found], return_index=True, return_inverse=True)
        top = np.full(new.size, np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(top, inv.reshape(-1), seq[~found])
        order = np.argsort(first, kind="stable")  # first appearance
        new, top = new[order], top[order]
        kept = top >= -1  # `raise_one` inserts what is at least -1
        self._insert(new[kept], top[kept])

    def set_to(self, group: I64, rank: I64, seq: I64) -> None:
        """`set_one` for each (group id, rank, seq) of distinct (group, rank), in order."""
        if not rank.size:
            return
        self._flush()
        self._view = None
        self._assign(self._codes_of(group, rank), seq)

    def seqs(self) -> dict[str, dict[int, int]]:
        """`seqs[group][rank]`: read only (rebuilt after each update)."""
        if self._view is None:
            self._flush()
            names = self.names.group_names
            order = np.argsort(self._order, kind="stable")
            view: dict[str, dict[int, int]] = {}
            codes = self._codes[order].tolist()
            for code, seq in zip(codes, self._seqs[order].tolist(), strict=True):
                view.setdefault(names[code >> _SHIFT], {})[code & _MASK] = seq
            self._view = view
        return self._view


class Arrivals:
    """When each rank was first seen, by its heartbeats, where it is now (its last group and
    sequence number): the hang tracker names a rank behind a peer only on a heartbeat the rank
    sent after the peer was seen there (see `HangTracker._unreported`). Ranks up to `max_rank`
    are tracked in arrays (tens of thousands of heartbeats a second at scale); others are not
    tracked (`first_seen` ignores them). Pure; no I/O."""

    def __init__(self, max_rank: int = 1 << 24) -> None:
        self._max_rank = max_rank
        self.clear()

    def clear(self) -> None:
        self._group = np.zeros(0, dtype=np.int64)
        self._seq = np.zeros(0, dtype=np.int64)
        self._since = np.zeros(0, dtype=np.float64)

    def _grow(self, top: int) -> None:
        size = min(max(top + 1, 2 * self._since.size), self._max_rank)
        grown = size - self._since.size
        if grown > 0:
            self._group = np.concatenate([self._group, np.full(grown, -2, dtype=np.int64)])
            self._seq = np.concatenate([self._seq, np.full(grown, -1, dtype=np.int64)])
            self._since = np.concatenate([self._since, np.full(grown, np.nan)])

    def observe(self, rank: I64, group: I64, seq: I64, time_s: npt.NDArray[np.float64]) -> None:
        """Heartbeats of distinct ranks `rank` (group id, -1 for none; seq; sent at `time_s`),
        each the newest of its rank."""
        if not rank.size:
            return
        tracked = rank < self._max_rank
        if not tracked.all():
            rank, group, seq, time_s = rank[tracked], group[tracked], seq[tracked], time_s[tracked]
            if not rank.size:
                return
        top = int(rank.max())
        if top >= self._since.size:
            self._grow(top)
        moved = (self._group[rank] != group) | (self._seq[rank] != seq)
        if moved.any():
            at = rank[moved]
            self._group[at] = group[moved]
            self._seq[at] = seq[moved]
            self._since[at] = time_s[moved]

    def observe_one(self, rank: int, group: int, seq: int, time_s: float) -> None:
        """`observe` for one heartbeat (no arrays built: offline replays go beat by beat)."""
        if not 0 <= rank < self._max_rank:
            return
        if rank >= self._since.size:
            self._grow(rank)
        if self._group[rank] != group or self._seq[rank] != seq:
            self._group[rank], self._seq[rank], self._since[rank] = group, seq, time_s

    def first_seen(self, ranks: list[int]) -> float | None:
        """The earliest time one of `ranks` was seen where it is now (None: none was)."""
        known = [r for r in ranks if 0 <= r < self._since.size]
        if not known:
            return None
        seen = self._since[known]
        seen = seen[~np.isnan(seen)]
        return float(seen.min()) if seen.size else None
