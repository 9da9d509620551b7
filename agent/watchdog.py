"""The progress watchdog's decision: is a rank hung? Pure: snapshots and a clock in, verdicts out.

A rank is suspected hung when its progress page has not moved for longer than a threshold learned
from its recent step times (`hang_factor` x the slowest of the last steps, never below
`min_hang_s`; `startup_grace_s` before its first step, while it computes between steps (an
evaluation or a save in the training loop's own code) and while torch.compile compiles). One
suspicion is raised per stall: the rank must make progress again before it can be flagged
again. No I/O here.
"""

from __future__ import annotations

import collections
import dataclasses

from vigil import schema
from vigil.agent import progress

_HISTORY = 32
# Between steps, a rank computing runs its loop's own code; one waiting in a collective waits
# for a peer, loading data (a "data" span) is the next step's work, a checkpoint span a save.
_OUTSIDE_STATE = schema.RankState.COMPUTE


@dataclasses.dataclass(frozen=True)
class HangSuspect:
    snapshot: progress.PageSnapshot
    stalled_s: float
    threshold_s: float


@dataclasses.dataclass
class _RankState:
    step_times: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_HISTORY)
    )
    last_seen_step: int = -1
    flagged_progress: float = -1.0


class Watchdog:
    def __init__(self, *, hang_factor: float, min_hang_s: float, startup_grace_s: float) -> None:
        self.hang_factor = hang_factor
        self.min_hang_s = min_hang_s
        self.startup_grace_s = startup_grace_s
        self._ranks: dict[tuple[str, int], _RankState] = {}

    def threshold_s(self, job: str, rank: int) -> float:
        state = self._ranks.get((job, rank))
        if state is None or not state.step_times:
            return self.startup_grace_s
        return max(self.min_hang_s, self.hang_factor * max(state.step_times))

    def observe(self, snap: progress.PageSnapshot, now_mono: float) -> HangSuspect | None:
        """Learn from `snap`; return a suspicion the first time its stall crosses the threshold."""
        state = self._ranks.setdefault((snap.job, snap.rank), _RankState())
        if snap.last.step != state.last_seen_step and snap.last.step >= 0:
            state.last_seen_step = snap.last.step
            state.step_times.append(snap.last.step_time_s)
        if snap.state is schema.RankState.FINISHED or snap.progress_mono_s <= 0:
            return None
        stalled = now_mono - snap.progress_mono_s
        threshold = self.threshold_s(snap.job, snap.rank)
        if snap.compiling or (snap.between_steps and snap.state is _OUTSIDE_STATE):
            threshold = max(threshold, self.startup_grace_s)
        if stalled <= threshold or state.flagged_progress == snap.progress_mono_s:
            return None
        state.flagged_progress = snap.progress_mono_s
        return HangSuspect(snap, stalled, threshold)

    def forget(self, job: str, rank: int) -> None:
        self._ranks.pop((job, rank), None)
