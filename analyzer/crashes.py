"""Crash detection: which ranks of a job are alive, and which died, from their signs of life.

The SDK's background thread sends a heartbeat each second whatever the training thread does: a
hung rank keeps sending them, a dead one does not. Step records are signs of life too
(`observe_step_ends`): a rank whose steps keep ending is alive however many of its heartbeats
were lost. A rank silent in both, without its last word (`finished`; `failed` when an exception
ended the process; `terminated` when SIGTERM or Ctrl-C stopped it), was killed outright; when
its peers then end `failed` (their collectives broke) or `terminated` (torchrun stops a failed
rank's survivors with SIGTERM) or keep beating (they wait for it), it is the crash's culprit.
When every rank that stopped had its last word, the first to stop is: the first to fail, or the
ranks stopped by SIGTERM before any failed (an eviction, a preempted or drained node). A job
whose every rank was stopped by SIGTERM or Ctrl-C and none failed was stopped, not crashed: no
finding.

`Liveness` holds one job's signs of life; `HangTracker` (`hangs`) owns one and turns what
`Liveness.culprits` answers into a finding with `crash_finding`. Pure: the caller supplies
`now_s`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import findings

# The SDK sends a heartbeat each second: 5 s without one (and no last word) is a dead process,
# not a slow flush; a peer that beat within 2.5 s is alive. Failing peers' last heartbeats, and
# the beats of peers still waiting, reach a collector within about 3 s of the first failure (a
# flush interval, a POST, a retry); a rank that stopped by then (0.5 s slack for its last
# flush) stopped first.
CRASH_SILENCE_S = 5.0
# ... but where a job's heartbeats have been seen to go missing, twice the longest gap seen (a
# rank's beats lost at random with probability p are missing n in a row with p**n), to here.
CRASH_SILENCE_MAX_S = 15.0
ALIVE_S = 2.5
PEERS_SETTLE_S = 3.0
BEAT_SLACK_S = 0.5
# How `Liveness.culprits` names a crash's culprits when none stopped without a last word; the
# tracker then looks for a better answer (`LEFT_EARLY`, `HUNG`).
FAILED_FIRST = "failed first"
STOPPED_FIRST = (
    "stopped by SIGTERM or Ctrl-C while its peers ran (an eviction, a preemption, a drained "
    "node or a user's kill)"
)
LEFT_LOOP = "left the training loop while its peers were still in it (uneven data across ranks?)"
LEFT_EARLY = f"finished early: {LEFT_LOOP}"
HUNG = "hung, and its peers failed waiting for it (a collective timeout)"


class Liveness:
    """One job's signs of life: each rank's newest heartbeat and step end, and when the ranks
    that said `failed` said it."""

    def __init__(self) -> None:
        self.last_beat: dict[int, float] = {}  # rank -> time of its newest heartbeat
        self.beat_gap_s = 0.0  # the longest time between two of one rank's heartbeats seen
        # Per rank, the newest end of a step it reported (-inf: none).
        self.step_ends = np.full(0, -np.inf)
        self.failed: dict[int, float] = {}  # rank -> when it said `failed`
        self.terminated: dict[int, float] = {}  # rank -> when it said `terminated`

    def clear(self) -> None:
        """Forget everything (the job's ranks are being restarted)."""
        self.last_beat.clear()
        self.beat_gap_s = 0.0
        self.step_ends = np.full(0, -np.inf)
        self.failed.clear()
        self.terminated.clear()

    @property
    def stopped(self) -> dict[int, float]:
        """The ranks that said their last word `failed` or `terminated`, and when."""
        return self.failed | self.terminated

    def beat(self, rank: int, time_s: float, state: schema.RankState) -> float:
        """`rank` sent a heartbeat at `time_s` in `state`; returns its previous newest (0:
        none), which is newer than `time_s` for a heartbeat that arrived late."""
        newest = self.last_beat.get(rank, 0.0)
        self.last_beat[rank] = max(newest, time_s)
        if newest > 0.0:
            self.beat_gap_s = max(self.beat_gap_s, time_s - newest)
        if state is schema.RankState.FAILED:
            self.failed.setdefault(rank, time_s)
        elif state is schema.RankState.TERMINATED:
            self.terminated.setdefault(rank, time_s)
        return newest

    def beats(
        self,
        ranks: list[int],
        times_s: npt.NDArray[np.float64],
        failed: npt.NDArray[np.bool_],
        terminated: npt.NDArray[np.bool_],
    ) -> npt.NDArray[np.float64]:
        """`beat` for distinct `ranks` at once (vectorised; `failed`, `terminated`: their
        last words); returns their previous newest."""
        beat = self.last_beat
        newest = np.fromiter((beat.get(r, 0.0) for r in ranks), np.float64, len(ranks))
        beat.update(zip(ranks, np.maximum(newest, times_s).tolist(), strict=True))
        seen = newest > 0.0
        if seen.any():
            self.beat_gap_s = max(self.beat_gap_s, float((times_s[seen] - newest[seen]).max()))
        for i in np.flatnonzero(failed).tolist():
            self.failed.setdefault(ranks[i], float(times_s[i]))
        for i in np.flatnonzero(terminated).tolist():
            self.terminated.setdefault(ranks[i], float(times_s[i]))
        return newest

    def observe_step_ends(
        self, ranks: npt.ArrayLike, ends_s: npt.ArrayLike, since_s: float
    ) -> None:
        """Ranks `ranks` ended steps at `ends_s` (their own clocks, as heartbeats); those before
        `since_s` (the latest restart) are ignored."""
        r = np.asarray(ranks, dtype=np.int64).reshape(-1)
        e = np.asarray(ends_s, dtype=np.float64).reshape(-1)
        keep = (r >= 0) & np.isfinite(e) & (e >= since_s)
        r, e = r[keep], e[keep]
        if not r.size:
            return
        top = int(r.max()) + 1
        if top > self.step_ends.size:
            grown = np.full(top, -np.inf)
            grown[: self.step_ends.size] = self.step_ends
            self.step_ends = grown
        np.maximum.at(self.step_ends, r, e)

    def alive_s(self, rank: int) -> float:
        """The newest sign of life of `rank`: its newest heartbeat or step end (0: none)."""
        beat = self.last_beat.get(rank, 0.0)
        if rank < self.step_ends.size:
            return max(beat, float(self.step_ends[rank]))
        return beat

    def silence_s(self) -> float:
        """How long a rank without a last word must be silent, while its peers beat, to be
        taken for dead: `CRASH_SILENCE_S`, or twice the longest gap between one rank's
        heartbeats seen in this job where beats have gone missing on their way before (a
        lossy network, a collector that dropped some, a flusher held up), at most
        `CRASH_SILENCE_MAX_S`."""
        return min(CRASH_SILENCE_MAX_S, max(CRASH_SILENCE_S, 2.0 * self.beat_gap_s))

    def culprits(
        self, now_s: float, known: set[int], finished: set[int], *, final: bool
    ) -> tuple[list[int], str] | None:
        """The crashed ranks and how they were told, or None while none is (`known`: the job's
        ranks; `finished`: those that said so; `final`: no more records will come)."""
        beats = self.last_beat
        if not beats:
            return None
        stopped = self.stopped
        ended = finished | set(stopped)
        if stopped:
            first = min(stopped.values())
            if not final and now_s < first + PEERS_SETTLE_S:
                return None  # the other ranks' last heartbeats may still be on their way
            # Silent since before the first to stop: living ranks beat each second (a rank
            # known from its collectives that never sent a heartbeat is silent too).
            culprits = sorted(
                r
                for r in known | set(beats)
                if r not in ended and self.alive_s(r) <= first + BEAT_SLACK_S
            )
            if culprits:
                return culprits, "stopped without a last word"
            return self._first_stopped(known | set(beats), finished)
        silence = self.silence_s()
        if now_s - min(beats.values()) < silence:
            return None  # every rank beat recently: none is silent
        silent = [
            r
            for r, t in beats.items()
            if r not in ended and now_s - t >= silence and now_s - self.alive_s(r) >= silence
        ]
        alive = [r for r, t in beats.items() if r not in ended and now_s - t < ALIVE_S]
        if not silent or not alive:
            return None
        return sorted(silent), "stopped while its peers kept beating"

    def _first_stopped(self, ranks: set[int], finished: set[int]) -> tuple[list[int], str] | None:
        """When every rank that stopped had its last word: the first to fail (its peers'
        collectives break only once its process is gone, after its last word); or the ranks
        stopped by SIGTERM before any failed (None where every rank was: the job was stopped
        as a whole, which is no crash)."""
        first_failure = min(self.failed.values(), default=float("inf"))
        early = sorted(r for r, t in self.terminated.items() if t < first_failure)
        if early:
            if set(early) | finished >= ranks:
                return None
            return early, STOPPED_FIRST
        return sorted(r for r, t in self.failed.items() if t == first_failure), FAILED_FIRST


def crash_finding(
    job_id: str,
    life: Liveness,
    culprits: list[int],
    how: str,
    *,
    now_s: float,
    last_step: int,
    last_progress_s: float,
) -> schema.Finding:
    """The crash finding naming `culprits` (`how`: what `Liveness.culprits` said)."""
    last = max(life.alive_s(r) for r in culprits)
    named = set(culprits)
    peers = [t for r, t in life.last_beat.items() if r not in named]
    shown = ", ".join(map(str, culprits[:8])) + ("..." if len(culprits) > 8 else "")
    failed, terminated = len(set(life.failed) - named), len(set(life.terminated) - named)
    return findings.make_finding(
        kind=schema.FindingKind.CRASH,
        job_id=job_id,
        subjects=schema.Subjects(ranks=culprits),
        step_start=last_step + 1,
        step_end=last_step + 1,
        summary=(
            f"crash: rank(s) {shown} {how} after step {last_step}"
            + (f"; {failed} rank(s) then failed" if failed else "")
            + (
                f"; {terminated} rank(s) were then stopped by SIGTERM or Ctrl-C"
                if terminated
                else ""
            )
        ),
        evidence=[
            findings.evidence(
                "silent_before_peers",
                max(max(peers) - last, 0.0) if peers else 0.0,
                unit="s",
                note="from the culprit's newest heartbeat to its peers' newest",
            ),
            findings.evidence("ranks_failed", len(life.failed)),
        ],
        confidence=0.9 if how != FAILED_FIRST else 0.7,
        detected_s=now_s,
        trace_start_s=last_progress_s,
        trace_end_s=now_s,
    )
