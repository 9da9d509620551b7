"""A job's rolling window of recent steps for the streaming analyzer, filled from records.

Rows are steps (a ring of `capacity` rows, row = step % capacity), columns ranks (grown as ranks
appear). Filling is vectorised per batch; `view(steps)` returns chronological `StepArrays` of
chosen steps for the array detectors. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from vigil import columns, schema
from vigil.analyzer import aggcols, attribution
from vigil.analyzer import arrays as arrays_mod
from vigil.columns import StepColumns

# The step-record fields add_steps reads, in this order (rank, step, start, end, ...).
_PICK = [
    columns.index(f)
    for f in (
        "rank",
        "step",
        "start_s",
        "end_s",
        "data_s",
        "comm_wait_s",
        "tokens",
        "mfu",
        "model_flops",
        "cpu_wait_s",
        "forward_s",
        "forward_cpu_wait_s",
        "pipeline_s",
        "pipeline_cpu_wait_s",
        "pipeline_comm_wait_s",
        "stage_backward_s",
        "stage_backward_wait_s",
    )
]
_FIELDS = (
    "step_time_s",
    "data_s",
    "comm_wait_s",
    "transfer_s",
    "tokens",
    "mfu",
    "sm_clock_hz",
    "throttled",
    "wait_s",
    "hidden_wait_s",
    "cpu_wait_s",
    "forward_s",
    "forward_cpu_wait_s",
    "pipeline_own_s",
    "stage_backward_own_s",
)
# Filled from collective aggregates by attribution, per row, when a row is viewed.
_ATTRIBUTED = ("transfer_s", "wait_s", "hidden_wait_s")


class StepWindow:
    """Recent steps x ranks of one job; see the module docstring."""

    def __init__(self, job_id: str, capacity: int, num_ranks: int = 0) -> None:
        self.job_id = job_id
        self.capacity = capacity
        self._cols: dict[int, int] = {}
        self._lookup = np.full(0, -1, dtype=np.int64)  # rank id -> column, -1 if unseen
        self._rank_ids: list[int] = []
        self._ids = np.zeros(0, dtype=np.int64)  # _rank_ids as an array (ranks only grow)
        self._nodes: list[str] = []
        self._devices: list[str] = []
        self._width = 0
        self._data = {name: np.full((capacity, 0), np.nan, dtype=np.float32) for name in _FIELDS}
        self.row_step = np.full(capacity, -1, dtype=np.int64)
        self.rank_newest = np.full(0, -1, dtype=np.int64)  # per column: newest step reported
        self.rank_end_s = np.full(0, -np.inf)  # per column: when its newest-ending step ended
        self.reported = np.zeros(capacity, dtype=np.int64)
        self.start_s = np.full(capacity, np.inf)
        self.end_s = np.full(capacity, -np.inf)
        self.stages: npt.NDArray[np.int32] | None = None  # indexed by rank id
        self.peak_flops = 0.0
        # Per ring row: the aggregates received for its step, attributed when the row is viewed
        # after new ones arrived (cross-rank: a step's ranks arrive in different batches).
        self._aggs: dict[int, list[attribution.AggColumns]] = {}
        self._dirty: set[int] = set()
        # Per ring row: its cells' transfer times for the slow-link check, as (ranks it was
        # computed over, result); dropped when the row receives aggregates or is reused.
        self._transfers: dict[int, tuple[int, attribution.GroupTransfer]] = {}
        self._keys: dict[tuple[str, str], int] = {}
        self.names = aggcols.Names(self._keys)  # group and (group, op class) ids
        self._p2p_seen = (0, False)  # (keys looked at, whether one was a p2p op's)
        # Ranks the job declared (its world size): waited for before a step is analysed, but
        # given columns only when they report, so memory follows the ranks that report.
        self.declared = num_ranks

    @property
    def num_ranks(self) -> int:
        """Ranks that reported something (each has a column)."""
        return len(self._rank_ids)

    @property
    def expected(self) -> int:
        """Ranks a step waits for: those that reported, or all the job declared."""
        return max(self.num_ranks, self.declared)

    def column(self, rank: int) -> int:
        col = self._cols.get(rank)
        if col is None:
            col = len(self._rank_ids)
            self._cols[rank] = col
            self._rank_ids.append(rank)
            self._nodes.append("")
            self._devices.append("")
            if col >= self._width:
                self._grow(max(8, 2 * self._width, col + 1))
        return col

    def _grow(self, width: int) -> None:
        if width <= self._width:
            return
        for name, old in self._data.items():
            new = np.full((self.capacity, width), np.nan, dtype=np.float32)
            new[:, : self._width] = old
            self._data[name] = new
        newest = np.full(width, -1, dtype=np.int64)
        newest[: self._width] = self.rank_newest
        self.rank_newest = newest
        ended = np.full(width, -np.inf)
        ended[: self._width] = self.rank_end_s
        self.rank_end_s = ended
        self._width = width

    def lengthen(self, capacity: int) -> None:
        """Hold `capacity` steps from now on (more than now): every held step keeps its data,
        moved to its row in the longer ring; steps older than the newest held less `capacity`
        are dropped (they would share a row)."""
        if capacity <= self.capacity:
            return
        held = np.flatnonzero(self.row_step >= 0)
        if held.size:
            held = held[self.row_step[held] > int(self.row_step[held].max()) - capacity]
        rows = self.row_step[held] % capacity
        for name, old in self._data.items():
            new = np.full((capacity, self._width), np.nan, dtype=np.float32)
            new[rows] = old[held]
            self._data[name] = new
        for name, fill in (("row_step", -1), ("reported", 0), ("start_s", np.inf),
                           ("end_s", -np.inf)):  # fmt: skip
            old_values = getattr(self, name)
            new_values = np.full(capacity, fill, dtype=old_values.dtype)
            new_values[rows] = old_values[held]
            setattr(self, name, new_values)
        moved = dict(zip(held.tolist(), rows.tolist(), strict=True))
        self._aggs = {moved[r]: v for r, v in self._aggs.items() if r in moved}
        self._dirty = {moved[r] for r in self._dirty if r in moved}
        self._transfers = {moved[r]: v for r, v in self._transfers.items() if r in moved}
        self.capacity = capacity

    def clear_steps(self) -> None:
        """Forget every step held (the job's ranks were relaunched and count their steps again):
        ranks, their nodes, group names and the ring's length stay."""
        for values in self._data.values():
            values.fill(np.nan)
        self.row_step.fill(-1)
        self.reported.fill(0)
        self.start_s.fill(np.inf)
        self.end_s.fill(-np.inf)
        self.rank_newest.fill(-1)
        self.rank_end_s.fill(-np.inf)
        self._aggs.clear()
        self._dirty.clear()
        self._transfers.clear()

    def relaunched_at(self, batch: StepColumns) -> float:
        """When the batch shows the job's ranks relaunched: the earliest start of a step record
        that trains again a step its rank already reported (a new process resumed from a
        checkpoint) and began after that rank's newest step ended (a retried shipment repeats
        records that began before); NaN: none does."""
        if not len(batch):
            return float("nan")
        values = batch.values[:, _PICK]
        cols = self.columns(values[:, 0].astype(np.int64))
        again = (values[:, 1] <= self.rank_newest[cols]) & (values[:, 2] >= self.rank_end_s[cols])
        return float(values[again, 2].min()) if again.any() else float("nan")

    def set_node(self, rank: int, node: str, device: str = "") -> None:
        col = self.column(rank)
        self._nodes[col] = node
        self._devices[col] = device

    def row_for(self, step: int) -> int:
        """The ring row of `step`, cleared if it held an older step."""
        row = step % self.capacity
        if self.row_step[row] != step:
            for values in self._data.values():
                values[row] = np.nan
            self.row_step[row] = step
            self._aggs.pop(row, None)
            self._transfers.pop(row, None)
            self._dirty.discard(row)
            self.reported[row] = 0
            self.start_s[row] = np.inf
            self.end_s[row] = -np.inf
        return row

    def columns(self, ranks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Columns of many ranks at once (new ranks get new columns)."""
        if ranks.size and int(ranks.max()) >= self._lookup.size:
            grown = np.full(max(int(ranks.max()) + 1, 2 * self._lookup.size), -1, dtype=np.int64)
            grown[: self._lookup.size] = self._lookup
            self._lookup = grown
        cols = self._lookup[ranks]
        for rank in np.unique(ranks[cols < 0]):
            self._lookup[rank] = self.column(int(rank))
        return self._lookup[ranks]

    def add_steps(self, batch: StepColumns, oldest_allowed: int) -> float:
        """Scatter step records (as columns) into the ring, vectorised.

        Returns the latest step end among the records (0 when there were none).
        """
        if not len(batch):
            return 0.0
        values = batch.values[:, _PICK]
        steps = values[:, 1].astype(np.int64)
        keep = steps >= oldest_allowed  # older steps were analysed and left the window
        latest_end = float(values[:, 3].max())
        if not keep.all():
            values, steps = values[keep], steps[keep]
        if not steps.size:
            return latest_end
        row = steps % self.capacity
        for step in aggcols.distinct(steps).tolist():
            self.row_for(int(step))
        col = self.columns(values[:, 0].astype(np.int64))
        step_time = values[:, 3] - values[:, 2]
        mfu = values[:, 7]
        if self.peak_flops > 0:
            derived = values[:, 8] / np.maximum(step_time, 1e-12) / self.peak_flops
            mfu = np.where(mfu > 0, mfu, derived)
        d = self._data
        fresh = np.isnan(d["step_time_s"][row, col])
        d["step_time_s"][row, col] = step_time
        d["data_s"][row, col] = values[:, 4]
        d["comm_wait_s"][row, col] = values[:, 5]
        d["tokens"][row, col] = values[:, 6]
        d["mfu"][row, col] = mfu
        d["cpu_wait_s"][row, col] = values[:, 9]
        d["forward_s"][row, col] = values[:, 10]
        d["forward_cpu_wait_s"][row, col] = values[:, 11]
        d["pipeline_own_s"][row, col] = arrays_mod.pipeline_own(
            step_time, values[:, 4], values[:, 5], values[:, 9], values[:, 12:15]
        )
        d["stage_backward_own_s"][row, col] = arrays_mod.stage_backward_own(
            values[:, 15], values[:, 16]
        )
        np.add.at(self.reported, row[fresh], 1)
        np.minimum.at(self.start_s, row, values[:, 2])
        np.maximum.at(self.end_s, row, values[:, 3])
        np.maximum.at(self.rank_newest, col, steps)
        np.maximum.at(self.rank_end_s, col, values[:, 3])
        return latest_end

    def quorum_step(self, share: float = 0.1) -> int:
        """The newest step that all but `share` of the ranks have reported (-1 if none)."""
        newest = self.rank_newest[: self.num_ranks]
        if newest.size == 0:
            return -1
        # Declared ranks that never reported count as having reported nothing (-1).
        silent = self.expected - newest.size
        position = int(share * (self.expected - 1))
        if position < silent:
            return -1
        return int(np.partition(newest, position - silent)[position - silent])

    def add_aggregates(
        self,
        records: Sequence[schema.CollectiveAggregate] | aggcols.AggBatch,
        oldest_allowed: int,
    ) -> None:
        """Keep a batch's aggregates (as records, or as arrays `aggcols.agg_batch` built with
        this window's `names`) with the rows of their steps."""
        batch = records if isinstance(records, aggcols.AggBatch) else self.agg_batch(records)
        if len(batch) and int(batch.step.min()) < oldest_allowed:
            batch = batch.take(batch.step >= oldest_allowed)
        if not len(batch):
            return
        steps = aggcols.distinct(batch.step).tolist()
        for step in steps:
            self.row_for(step)
        chunk = batch.columns(batch.step % self.capacity, self.columns(batch.rank))
        if len(steps) == 1:
            row = steps[0] % self.capacity
            self._aggs.setdefault(row, []).append(chunk)
            self._dirty.add(row)
            self._transfers.pop(row, None)
            return
        for row in aggcols.distinct(chunk.row).tolist():
            self._aggs.setdefault(row, []).append(chunk.take(chunk.row == row))
            self._dirty.add(row)
            self._transfers.pop(row, None)

    def agg_batch(self, records: Sequence[schema.CollectiveAggregate]) -> aggcols.AggBatch:
        return aggcols.agg_batch(records, self.names)

    def _attribute(self, rows: Sequence[int]) -> None:
        """Attribute the waits of rows that received aggregates since they were last viewed."""
        for row in rows:
            if row not in self._dirty:
                continue
            self._dirty.discard(row)
            joined = attribution.AggColumns.concat(self._aggs[row])
            joined.row = np.zeros_like(joined.row)
            result = aggcols.attribute_row(joined, self._width)
            for name in _ATTRIBUTED:
                self._data[name][row] = getattr(result, name)[0]

    def add_sample(self, rank: int, time_s: float, metric: str, value: float) -> None:
        """Attach an NVML reading to the newest step of `rank` that started before it."""
        col = self._cols.get(rank)
        if col is None:
            return
        started = np.flatnonzero((self.row_step >= 0) & (self.start_s <= time_s))
        if started.size == 0:
            return
        row = int(started[np.argmax(self.row_step[started])])
        if arrays_mod.is_sm_clock_metric(metric):
            self._data["sm_clock_hz"][row, col] = value
        elif arrays_mod.is_throttle_metric(metric):
            harmful = int(value) & arrays_mod.HARMFUL_THROTTLE_BITS
            self._data["throttled"][row, col] = 1.0 if harmful else 0.0

    def _row_transfer(self, row: int, n: int) -> attribution.GroupTransfer:
        """`attribution.group_transfer` of a row's aggregates from the first `n` columns,
        computed once per row and kept until the row changes."""
        cached = self._transfers.get(row)
        if cached is not None and cached[0] == n:
            return cached[1]
        parts = [chunk.take(chunk.col < n) for chunk in self._aggs.get(row, [])]
        joined = attribution.AggColumns.concat(parts)
        joined.row = np.zeros_like(joined.row)
        result = attribution.group_transfer(joined)
        self._transfers[row] = (n, result)
        return result

    def _rank_id_array(self) -> npt.NDArray[np.int64]:
        if self._ids.size != self.num_ranks:
            self._ids = np.asarray(self._rank_ids, dtype=np.int64)
        return self._ids

    def rank_stages(self) -> npt.NDArray[np.int32] | None:
        """Each column's pipeline stage; None when not known for every rank."""
        ids = self._rank_id_array()
        if self.stages is not None and ids.size and int(ids.max()) < self.stages.size:
            return self.stages[ids]
        return None

    def key_names(self) -> tuple[tuple[str, str], ...]:
        """The (group, op class) each aggregate key stands for, by key."""
        return tuple(sorted(self._keys, key=self._keys.__getitem__))

    def sends_p2p(self) -> bool:
        """Whether some rank's aggregates hold point-to-point ops (keys only grow: looked at
        again only when new ones came)."""
        if self._p2p_seen[0] != len(self._keys):
            self._p2p_seen = (len(self._keys), any(op == "p2p" for _, op in self._keys))
        return self._p2p_seen[1]

    def view(
        self, steps: Sequence[int], *, with_aggs: bool = False, with_transfers: bool = False
    ) -> arrays_mod.StepArrays:
        """Chronological arrays of `steps` (which must still be in the window); `with_aggs`:
        with their collective aggregates too; `with_transfers`: with their groups' transfer
        times (`attribution.group_transfer` of those aggregates, each row's kept between
        calls: the slow-link detector's input, not per batch).

        One step is a view into the ring (no copy): use it before the ring moves on.
        """
        n = self.num_ranks
        rows: npt.NDArray[np.int64] | slice
        if len(steps) == 1:
            first = steps[0] % self.capacity
            rows = slice(first, first + 1)
        else:
            rows = np.asarray([s % self.capacity for s in steps], dtype=np.int64)
        self._attribute([s % self.capacity for s in steps])
        d = {name: values[rows, :n] for name, values in self._data.items()}
        clock = d["sm_clock_hz"] if np.isfinite(d["sm_clock_hz"]).any() else None
        throttled = np.nan_to_num(d["throttled"]) if np.isfinite(d["throttled"]).any() else None
        ids = self._rank_id_array()
        parts = []
        for i, step in enumerate(steps if with_aggs else ()):
            for chunk in self._aggs.get(step % self.capacity, []):
                part = chunk.take(chunk.col < n)
                part.row = np.full_like(part.row, i)
                parts.append(part)
        return arrays_mod.StepArrays(
            job_id=self.job_id,
            steps=np.asarray(steps, dtype=np.int64),
            ranks=ids,
            step_time_s=d["step_time_s"],
            data_s=d["data_s"],
            comm_wait_s=d["comm_wait_s"] + np.nan_to_num(d["hidden_wait_s"]),
            transfer_s=d["transfer_s"],
            wait_s=d["wait_s"],
            aggs=attribution.AggColumns.concat(parts) if with_aggs else None,
            transfers=(
                attribution.GroupTransfer.concat(
                    [self._row_transfer(s % self.capacity, n) for s in steps], range(len(steps))
                )
                if with_transfers
                else None
            ),
            agg_keys=self.key_names(),
            tokens=d["tokens"],
            mfu=d["mfu"],
            cpu_wait_s=d["cpu_wait_s"],
            forward_s=d["forward_s"],
            forward_cpu_wait_s=d["forward_cpu_wait_s"],
            pipeline_own_s=d["pipeline_own_s"],
            stage_backward_own_s=d["stage_backward_own_s"],
            step_start_s=self.start_s[rows],
            step_end_s=self.end_s[rows],
            nodes=tuple(self._nodes),
            devices=tuple(self._devices) if any(self._devices) else (),
            stages=self.rank_stages(),
            sm_clock_hz=clock,
            throttled=throttled,
        )
