"""Hang detection: progress stopped for longer than a threshold learned from recent step times.

`HangTracker` follows one job: when steps end, and where each rank is (last collective sequence
number per process group, from heartbeats and collective aggregates). `check(now_s)` declares a
hang once no step has ended for `max(factor x median recent step time, slow_step_factor x the
95th percentile, min_s)` seconds (a job that has just turned slow, or one rank's one-off hiccup,
is not hung) and positions name a culprit (`waitgraph`: the ranks at the ends of the chains of
who waits for whom never entered the collective the others wait in); a stall nobody can be named
for is reported only after `unknown_culprit_factor` thresholds. A culprit whose newest heartbeat
predates the stall (its flusher delayed by a loaded CPU, its shipper retrying after a collector
restart) is late to report, not behind: the finding waits for its next heartbeat (a few seconds
at most, then names it with lower confidence). So is one whose newest heartbeat predates a
peer's arrival in the collective it is blamed for (`positions.Arrivals`): as a long pause that
named no one ends (a save only rank 0 makes), the first rank to enter the next collective is
seen there before its peers' next heartbeats show them entering too. A heartbeat that arrives
after a newer one of its rank does not move it back. Pure: the caller supplies `now_s`.

It also tells a crash from a hang by the ranks' signs of life: a hung rank keeps sending
heartbeats, a dead one does not (`crashes`, which holds the rule).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from vigil import schema
from vigil.analyzer import aggcols, crashes, hangreport, positions, waitgraph
from vigil.analyzer import config as config_mod

# The wait-for graph lives in `waitgraph`; these names are part of this module's interface.
Wait = waitgraph.Wait
Culprits = waitgraph.Culprits
find_culprits = waitgraph.find_culprits
behind_everywhere = waitgraph.behind_everywhere


# A rank between steps runs its loop's own code while it computes there: one waiting in a
# collective waits for someone else (peers at the barrier after a save one of them is stuck
# in), loading data (a "data" span) is the next step's work, and a checkpoint span has a rule
# of its own (`_saving`).
_OUTSIDE_STATE = schema.RankState.COMPUTE


def learned_threshold_s(recent_step_times_s: Sequence[float], cfg: config_mod.HangConfig) -> float:
    """Seconds without progress that count as a hang, given recent step times."""
    if len(recent_step_times_s) < cfg.warmup_steps:
        return cfg.warmup_s
    ordered = sorted(recent_step_times_s)
    slow = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return max(cfg.factor * statistics.median(ordered), cfg.slow_step_factor * slow, cfg.min_s)


class HangTracker:
    """One job's progress and rank positions; see the module docstring."""

    def __init__(
        self, job_id: str, cfg: config_mod.HangConfig, *, names: aggcols.Names | None = None
    ) -> None:
        self.job_id = job_id
        self.cfg = cfg
        self._step_times: deque[float] = deque(maxlen=cfg.history_steps)
        self._last_progress_s = 0.0
        self._grace_s = 0.0  # the last check that found the silence a save, compile or loop code
        self._save_seen_s = 0.0  # the last check that found a save no rank was behind in
        self._last_step = -1
        # Group ids shared with the caller's aggregate and heartbeat arrays (aggcols).
        self.names = names if names is not None else aggcols.Names({})
        self._positions = positions.Positions(self.names)
        self._arrivals = positions.Arrivals(_KNOWN_MAX)  # when each rank got where it is
        # rank -> (group id, seq, op) of the collective it says it waits in, oldest first.
        self._waits: dict[int, tuple[int, int, str]] = {}
        self._finished: set[int] = set()
        self._checkpointing: set[int] = set()
        # Ranks between steps (`Heartbeat.between_steps`), and those of them computing there:
        # in their loop's own code.
        self._between: set[int] = set()
        self._outside: set[int] = set()
        self._compiling: set[int] = set()  # ranks whose torch.compile is compiling
        self._checkpoints: dict[int, int] = {}  # rank -> checkpoint spans it has finished
        # rank -> its newest heartbeat: the collective it entered last, by name (desyncs).
        self._entered: dict[int, schema.Heartbeat] = {}
        self._ranks: set[int] = set()
        self._known = np.zeros(0, dtype=bool)  # by rank: in `_ranks` (a fast check for batches)
        self._open: schema.Finding | None = None
        # Set when a supervisor restarts the job: until a step ends again the silence is the
        # restart's, not a hang, and rank positions start over.
        self._restarted_s: float | None = None
        # The latest restart: heartbeats older than it describe ranks that no longer exist.
        self._epoch_s = 0.0
        self._life = crashes.Liveness()  # heartbeats, step ends, last words: the crash rule's
        self._crash: schema.Finding | None = None

    @property
    def last_progress_s(self) -> float:
        return self._last_progress_s

    def observe_step_time(
        self, step: int, end_s: float, step_time_s: float, start_s: float | None = None
    ) -> None:
        """A step completed (job-level: typically the median step time over its ranks)."""
        self._step_times.append(step_time_s)
        self.observe_progress(step, end_s, start_s)

    def observe_progress(self, step: int, end_s: float, start_s: float | None = None) -> None:
        """A step ended at `end_s` (`start_s`: when it started, if known)."""
        if end_s > self._last_progress_s:
            self._last_progress_s = end_s
        self._last_step = max(self._last_step, step)
        # The restart is over once a step of the new attempt ends: one that started after it
        # (the old attempt's ranks may finish a step while they are being stopped).
        restarted = self._restarted_s
        if restarted is not None and end_s > restarted and (start_s is None or start_s > restarted):
            self._restarted_s = None

    def observe_step_ends(self, ranks: npt.ArrayLike, ends_s: npt.ArrayLike) -> None:
        """Ranks `ranks` ended steps at `ends_s` (their own clocks, as heartbeats): signs of
        life for the crash rule (vectorised: a streaming batch's step records at once)."""
        self._life.observe_step_ends(ranks, ends_s, self._epoch_s)

    def rewind(self) -> None:
        """The job's ranks count their steps again from a checkpoint's (a relaunch): the last
        step is the newest to end from now on."""
        self._last_step = -1

    def restarting(self, now_s: float) -> None:
        """The job's ranks are being restarted (a recovery action): forget positions."""
        self._restarted_s = now_s
        self._epoch_s = max(self._epoch_s, now_s)
        self._last_progress_s = max(self._last_progress_s, now_s)
        self._grace_s = self._save_seen_s = 0.0
        self._positions.clear()
        self._arrivals.clear()
        self._waits.clear()
        self._finished.clear()
        self._checkpointing.clear()
        self._between.clear()
        self._outside.clear()
        self._compiling.clear()
        self._checkpoints.clear()
        self._entered.clear()
        self._life.clear()
        self._crash = None

    def expect_ranks(self, ranks: Iterable[int]) -> None:
        """The job's ranks (from its declared world size): one that dies before it sends
        anything is still known, and silent."""
        self._ranks.update(int(r) for r in ranks)

    def observe_seq(self, rank: int, group: str, seq: int, op: str, *, now: bool = False) -> None:
        """The last sequence number `rank` entered in `group` (e.g. from a collective aggregate);
        `now`: the rank's current position (a heartbeat), which wins even if lower (a restarted
        rank counts from zero again)."""
        self._ranks.add(rank)
        if not group:
            return
        if now:
            self._positions.set_one(group, rank, seq)
        else:
            self._positions.raise_one(group, rank, seq)

    def _know(self, ranks: npt.NDArray[np.int64]) -> None:
        """Add `ranks` to the known ranks (a set: skipped when all are in it already)."""
        if ranks.size and not (
            int(ranks.max()) < self._known.size and bool(self._known[ranks].all())
        ):
            self._ranks.update(ranks.tolist())
            top = max(self._ranks)
            if top < _KNOWN_MAX:
                self._known = np.zeros(top + 1, dtype=bool)
                self._known[list(self._ranks)] = True

    def observe_seqs(self, aggs: aggcols.AggBatch) -> None:
        """`observe_seq` for each aggregate of a batch (vectorised)."""
        if not len(aggs):
            return
        self._know(aggs.rank)
        self._positions.raise_to(aggs.group, aggs.rank, aggs.last_seq)

    def observe_position(
        self,
        rank: int,
        group: str,
        seq: int,
        op: str,
        state: schema.RankState,
        *,
        between_steps: bool = False,
        compiling: bool = False,
    ) -> None:
        """Where a rank is now and what it is doing (from a heartbeat)."""
        self.observe_seq(rank, group, seq, op, now=True)
        for ranks, now in (
            (self._between, between_steps),
            (self._outside, between_steps and state is _OUTSIDE_STATE),
            (self._compiling, compiling),
        ):
            if now:
                ranks.add(rank)
            else:
                ranks.discard(rank)
        if state is schema.RankState.IN_COLLECTIVE and group:
            self._waits[rank] = (self.names.group_id(group), seq, op)
        else:
            self._waits.pop(rank, None)
        for states, wanted in (
            (self._finished, schema.RankState.FINISHED),
            (self._checkpointing, schema.RankState.CHECKPOINTING),
        ):
            if state is wanted:
                states.add(rank)
            else:
                states.discard(rank)

    def observe_heartbeat(self, hb: schema.Heartbeat) -> None:
        if self._crash is not None and self._relaunched(hb):
            self.restarting(hb.time_s)
        if hb.time_s < self._epoch_s:
            return  # sent by a rank of an attempt that has since been restarted
        newest = self._life.beat(hb.rank, hb.time_s, hb.state)
        self._checkpoints[hb.rank] = max(self._checkpoints.get(hb.rank, 0), hb.checkpoints)
        if hb.time_s < newest:
            return  # arrived after a newer one (a retried shipment): where the rank was, not is
        self._entered[hb.rank] = hb
        gid = self.names.group_id(hb.last_group) if hb.last_group else -1
        self._arrivals.observe_one(hb.rank, gid, hb.last_seq, hb.time_s)
        self.observe_position(
            hb.rank, hb.last_group, hb.last_seq, hb.last_op, hb.state,
            between_steps=hb.between_steps, compiling=hb.compiling,
        )  # fmt: skip

    def observe_heartbeats(
        self, beats: Sequence[schema.Heartbeat], arrays: aggcols.BeatBatch | None = None
    ) -> None:
        """`observe_heartbeat` for each of `beats`, in order (`arrays`: them as arrays, if
        built), vectorised. Ranks are independent of each other here, so where a rank sent
        several (batches merged, or a sender's shipment spanning seconds) each rank's first
        heartbeats are taken together, then each rank's second, ...: every rank's in its order."""
        if self._crash is not None:  # a relaunch may begin in this batch: beat by beat
            for beat in beats:
                self.observe_heartbeat(beat)
            return
        b = arrays if arrays is not None else aggcols.beat_batch(beats, self.names)
        if not len(b):
            return
        if aggcols.repeats(b.rank):
            nth = aggcols.occurrence(b.rank)
            for k in range(int(nth.max()) + 1):
                self._distinct_beats(b.take(nth == k))
            return
        self._distinct_beats(b)

    def _relaunched(self, hb: schema.Heartbeat) -> bool:
        """Whether `hb`, sent after the crash was found, comes from a new process of a rank the
        crash ended (its culprit, or one that failed): its launcher restarted the job
        (`torchrun --max-restarts`) without a restart action reaching vigil. Hangs and crashes
        of the new attempt are then tracked from scratch."""
        crash = self._crash
        if crash is None or hb.time_s <= crash.detected_s:
            return False
        if hb.state in _LAST_WORDS:
            return False  # the old process's last words
        return hb.rank in crash.subjects.ranks or hb.rank in self._life.stopped

    def _distinct_beats(self, b: aggcols.BeatBatch) -> None:
        """`observe_heartbeats` of arrays in which no rank occurs twice."""
        kept = b.time_s >= self._epoch_s  # older ones: ranks of an attempt since restarted
        if not kept.all():
            b = b.take(kept)
        ranks = b.rank.tolist()
        failed = b.state_code == aggcols.STATE_CODES[schema.RankState.FAILED]
        terminated = b.state_code == aggcols.STATE_CODES[schema.RankState.TERMINATED]
        newest = self._life.beats(ranks, b.time_s, failed, terminated)
        done = self._checkpoints
        for i in np.flatnonzero(b.checkpoints > 0).tolist():
            done[ranks[i]] = max(done.get(ranks[i], 0), int(b.checkpoints[i]))
        # One that arrived after a newer one (a retried shipment) says where the rank was.
        now = b.time_s >= newest
        if not now.all():
            b = b.take(now)
            ranks = b.rank.tolist()
        self._arrivals.observe(b.rank, b.group, b.seq, b.time_s)
        records = b.records
        self._entered.update(zip(ranks, map(records.__getitem__, b.at.tolist()), strict=True))
        self._positions_now(b, ranks)

    def _positions_now(self, b: aggcols.BeatBatch, ranks: list[int]) -> None:
        """`observe_position` of each of `b` (distinct ranks `ranks`)."""
        self._know(b.rank)
        grouped = b.group >= 0
        self._positions.set_to(b.group[grouped], b.rank[grouped], b.seq[grouped])
        codes = aggcols.STATE_CODES
        waiting = np.flatnonzero((b.state_code == codes[schema.RankState.IN_COLLECTIVE]) & grouped)
        if self._waits and waiting.size < len(ranks):
            gone = self._waits.keys() & set(ranks)
            gone.difference_update(b.rank[waiting].tolist())
            for rank in gone:
                del self._waits[rank]
        if waiting.size:
            where = zip(
                b.group[waiting].tolist(), b.seq[waiting].tolist(), b.ops(waiting), strict=True
            )
            self._waits.update(zip(b.rank[waiting].tolist(), where, strict=True))
        for states, state in (
            (self._finished, schema.RankState.FINISHED),
            (self._checkpointing, schema.RankState.CHECKPOINTING),
        ):
            those = b.state_code == codes[state]
            if states:
                states.difference_update(ranks)
            if those.any():
                states.update(b.rank[those].tolist())
        for flagged, now in (
            (self._between, b.between),
            (self._outside, b.between & (b.state_code == codes[_OUTSIDE_STATE])),
            (self._compiling, b.compiling),
        ):
            if flagged:
                flagged.difference_update(ranks)
            if now.any():
                flagged.update(b.rank[now].tolist())

    def _wait_list(self) -> list[Wait]:
        names = self.names.group_names
        return [
            Wait(rank=rank, group=names[g], seq=seq, op=op)
            for rank, (g, seq, op) in self._waits.items()
        ]

    def threshold_s(self) -> float:
        """The learned threshold; the warm-up one while a rank is in a save no peer has
        finished yet (a long save every rank makes, or one only this rank makes: rank 0
        writing the whole state while its peers wait at a barrier), while the job is in its
        loop's own code (`_in_loop_code`), or while a rank's torch.compile compiles (a
        recompilation mid-run); longer while a rank is in a save its peers took long to finish
        (`_silence`)."""
        return self._silence(self._grace())[1]

    def _threshold(self, grace: bool) -> float:
        learned = learned_threshold_s(list(self._step_times), self.cfg)
        if grace or self._restarted_s is not None:
            return max(learned, self.cfg.warmup_s)
        return learned

    def _grace(self) -> bool:
        """Whether the job's silence is a save, a compile or its loop's own code (above)."""
        return bool(self._saving() or self._compiling or self._in_loop_code())

    def _in_loop_code(self) -> bool:
        """Whether every rank is between steps and some compute there: an evaluation every rank
        runs, a save rank 0 makes while its peers wait at a barrier. One rank computing between
        steps while its peers wait in the next step holds them up in code no step times (a save
        without a checkpoint span, a hang before its step): its silence counts as usual."""
        if not self._outside:
            return False
        between = self._between
        return all(rank in between for rank in self._ranks if rank not in self._finished)

    def _saving(self) -> bool:
        """Whether some rank is checkpointing and not behind: no peer has finished more
        checkpoint spans than it (a rank still in a save its peers have finished is held up
        there, and its silence counts like any other)."""
        if not self._checkpointing:
            return False
        done = self._checkpoints
        most = max(done.values(), default=0)
        return any(done.get(rank, 0) >= most for rank in self._checkpointing)

    def due_s(self) -> float | None:
        """The earliest time `check` could find a hang, as things stand: just after the
        silence passes the threshold (None while a hang or crash is open, or before any
        progress). A caller that checks about once a second checks then too: a hang is found up
        to a second sooner."""
        if self._crash is not None or self._open is not None or self._last_progress_s <= 0:
            return None
        since, threshold = self._silence(self._grace())
        return since + threshold + _DUE_AFTER_S

    def _silence(self, grace: bool) -> tuple[float, float]:
        """When the silence began, and how long it may last:
        - the last progress, and the threshold (`_threshold`);
        - once a save, a compile or the loop's own code is over, from the last check that saw
          it (the steps it held up are only now on their way, and the ranks' heartbeats tell
          that it is over a little apart);
        - but while a rank is still in a save its peers have finished, from the last progress,
          for the threshold or `_SAVE_SKEW` times as long as the peers' saves took (until the
          last check that saw them saving), whichever is longer: the culprit's save began with
          theirs, so it has had their save's time already; on a long save, a rank writing to
          slower storage may take longer than its peers plus one threshold, and is not hung."""
        progress = self._last_progress_s
        threshold = self._threshold(grace)
        if grace:
            return progress, threshold
        saved = self._save_seen_s - progress
        if self._checkpointing and saved > 0 and self._save_seen_s >= self._grace_s:
            return progress, max(threshold, _SAVE_SKEW * saved)
        return max(progress, self._grace_s), threshold

    def check(self, now_s: float, *, final: bool = False) -> schema.Finding | None:
        """A new or resolved hang finding, a crash finding, or None when nothing changed
        (`final`: no more records will come, e.g. the end of an offline replay)."""
        if self._crash is not None:
            return None
        crash = self._check_crash(now_s, final=final)
        if crash is not None or self._life.stopped:
            # A job whose ranks are failing or being stopped is not hung: its crash is reported
            # (or will be, once the peers' last heartbeats are in), or it was stopped.
            return crash
        if self._last_progress_s <= 0:
            return None
        saving = self._saving()
        grace = saving or self._grace()
        if grace:
            self._grace_s = now_s
        if saving:
            self._save_seen_s = now_s
        since, threshold = self._silence(grace)
        silent = now_s - since
        if self._open is not None:
            if silent < threshold:  # progress resumed
                resolved = self._open
                self._open = None
                return _resolved(resolved, self._last_step)
            return None
        if silent <= threshold or (self._ranks and self._finished >= self._ranks):
            return None
        culprits = self._desynced() or find_culprits(
            self._wait_list(), self._positions.seqs(), self._ranks
        )
        if culprits is None and silent <= threshold * self.cfg.unknown_culprit_factor:
            return None  # nobody to name yet: positions may still show who, or steps resume
        # A culprit is behind on a heartbeat sent after the stall began and after a peer was
        # seen in (or past) the collective it is blamed for: one sent before says where it was
        # when its peers were there too (as a long pause ends, the first rank to enter the
        # next collective is seen there a moment before the others' next heartbeats).
        there = self._peers_there_s(culprits)
        late = self._unreported(culprits, max(since + threshold / 2, there))
        if late and not final and now_s <= max(since + threshold, there) + _LATE_REPORT_S:
            return None  # their newest positions predate the stall: wait for them to report
        self._open = self._hang_finding(now_s, silent, threshold, culprits, late)
        return self._open

    def _desynced(self) -> Culprits | None:
        """Culprits when members of a group entered different collectives as the same one,
        by their newest heartbeats (point-to-point pairs aside: a send meets a receive)."""
        at: dict[tuple[str, int], dict[int, str]] = {}
        for rank, hb in self._entered.items():
            if hb.last_group and hb.last_op and ":p2p:" not in hb.last_group:
                at.setdefault((hb.last_group, hb.last_seq), {})[rank] = hb.last_op
        for (group, seq), ops in sorted(at.items()):
            found = waitgraph.desync(group, seq, ops)
            if found is not None:
                return waitgraph.desync_culprits(found)
        return None

    def _left_early(self) -> list[int]:
        """Ranks that finished (left their training loop) behind a peer that has not: in some
        group, a collective the peer entered after their last."""
        finished = self._finished
        early: set[int] = set()
        for members in self._positions.seqs().values() if finished else ():
            going = max((s for r, s in members.items() if r not in finished), default=-1)
            early.update(r for r in finished if members.get(r, going) < going)
        return sorted(early)

    def _peers_there_s(self, culprits: Culprits | None) -> float:
        """When a peer of the culprits (not one of them) was first seen in or past the
        collective they are blamed for, where it still is (0.0: unknown)."""
        if culprits is None:
            return 0.0
        members = self._positions.seqs().get(culprits.group, {})
        named = set(culprits.ranks)
        there = [r for r, seq in members.items() if seq >= culprits.seq and r not in named]
        seen = self._arrivals.first_seen(there)
        return 0.0 if seen is None else seen

    def _unreported(self, culprits: Culprits | None, since: float) -> list[int]:
        """The culprits whose newest heartbeat was sent before `since` (half the threshold, at
        least one median step, past the silence's start, and no sooner than a peer was seen in
        the collective they are blamed for), too early to show where they stopped: a healthy
        rank may still be on its way to the collective its peers wait in. Under load a
        rank's flusher thread, or its shipper after a collector restart, reports late; its
        stale position (not waiting, behind) must not make it a culprit. Empty when no rank
        sent heartbeats (positions from aggregates alone)."""
        beats = self._life.last_beat
        if culprits is None or not beats:
            return []
        return [r for r in culprits.ranks if beats.get(r, 0.0) < since]

    def _check_crash(self, now_s: float, *, final: bool) -> schema.Finding | None:
        found = self._life.culprits(now_s, self._ranks, self._finished, final=final)
        if found is None:
            return None
        if found[1] == crashes.FAILED_FIRST:
            # Failed because a peer had left the loop, or after a hang (a collective timeout):
            # that peer, or the hang's culprits, not the first victim to give up.
            early = self._left_early()
            hung = list(self._open.subjects.ranks) if self._open is not None else []
            if early:
                found = early, crashes.LEFT_EARLY
            elif hung:
                found = hung, crashes.HUNG
        self._crash = crashes.crash_finding(
            self.job_id, self._life, *found,
            now_s=now_s, last_step=self._last_step, last_progress_s=self._last_progress_s,
        )  # fmt: skip
        return self._crash

    def crash_silence_s(self) -> float:
        """How long a silent rank must be silent to be taken for dead (`Liveness.silence_s`)."""
        return self._life.silence_s()

    def _hang_finding(
        self,
        now_s: float,
        silent: float,
        threshold: float,
        culprits: Culprits | None,
        late: Sequence[int],
    ) -> schema.Finding:
        stall = hangreport.Stall(
            job_id=self.job_id, now_s=now_s, silent_s=silent, threshold_s=threshold,
            median_step_s=statistics.median(self._step_times) if self._step_times else 0.0,
            last_step=self._last_step, last_progress_s=self._last_progress_s,
            seqs=self._positions.seqs(), waiting=len(self._waits), outside=self._outside,
            compiling=self._compiling, finished=self._finished,
        )  # fmt: skip
        return hangreport.hang_finding(stall, culprits, late)


# A rank still in a save its peers have finished is hung once its save has lasted this many
# times as long as theirs (and the threshold): storage serves ranks at different speeds.
_SAVE_SKEW = 2.0
# `due_s` is this long past the threshold: a check must find the silence longer than it.
_DUE_AFTER_S = 0.01
# The states a process sends last, as it ends.
_LAST_WORDS = frozenset(
    {schema.RankState.FAILED, schema.RankState.FINISHED, schema.RankState.TERMINATED}
)
# Rank ids up to this get the known-rank mask (16 MiB at most); larger ones are looked up.
_KNOWN_MAX = 1 << 24
# How much longer than the threshold a hang waits for culprits whose newest heartbeat predates
# the stall (a flusher delayed by a loaded CPU, a shipper retrying after a collector restart):
# their beats reach a collector within about 3 s, as a failing peer's last one does.
_LATE_REPORT_S = crashes.PEERS_SETTLE_S


def _resolved(finding: schema.Finding, last_step: int) -> schema.Finding:
    return msgspec.structs.replace(
        finding, state=schema.FindingState.RESOLVED, step_end=max(finding.step_end, last_step)
    )
