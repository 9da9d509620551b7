"""One job's streaming analysis: its window, persistence counts, hang tracker, open findings.

`JobStream.feed(records)` adds a batch of one job's records to its window (`window.py`) and
analyses the steps that became ready (every known rank reported them, or 90 % of ranks reported a
step `stream_step_lag` newer), oldest first: each step's row is scored (`stragglers.score`), the
rolling persistence counts updated, and only when a rank newly becomes persistent (or, every
`retry_every` steps, while a persistent episode has no finding yet) the offline detectors run over
the window, so streaming and `vigil analyze` agree. Open straggler and data-stall findings are
re-described every persistence window of steps and re-sent when that says more (`says_more`).
Pure: no I/O, no clocks, no threads. `streaming.py` routes batches to each job's stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from vigil import columns, schema
from vigil.analyzer import aggcols, hangs, imbalance, links, mfu, robust, shape, stragglers
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import window as window_mod

Kind = schema.FindingKind
# A persistent rank that detection did not report is looked at again every analysed step in
# jobs of up to `RANKS_PER_RETRY_STEP` ranks, every 2 steps up to twice as many, ..., at most
# every `RETRY_STEPS` (`JobStream.retry_every`; a detection over the window costs ~10 us a
# rank, ~0.1 s at 10,000 ranks): the finding comes at most that many steps after offline
# analysis would date it.
RETRY_STEPS = 3
RANKS_PER_RETRY_STEP = 1024
# Links and imbalance are judged over the window every step for jobs of up to this many ranks,
# every 2 steps up to twice as many, ... (`JobStream.judge_every`): ~2-3 ms a step at most.
RANKS_PER_JUDGED_STEP = 256
# A job whose ranks ship many steps a batch (fast steps, a 1 s flush) gets a longer window: 4
# batches' worth of steps, so that a step is analysed once every rank's batch holding it came
# (a rank's batch can end a batch's span ahead of another's, and the ring is analysed to half
# its length ahead of the newest step), at most this many steps and no more cells (steps x
# ranks) than the default window holds at 10,000 ranks.
MAX_WINDOW_STEPS = 1024
MAX_WINDOW_CELLS = 64 * 10_000
BATCHES_HELD = 4
# An open straggler or data-stall finding is re-described from the window every persistence
# window of steps (every 10 such windows per 10,000 ranks: a detection costs ~0.1 s there), and
# re-sent when its shape changed or its headline ratio moved by this share: a ramp keeps
# growing, and an intermittent straggler's pattern shows only after a few of its periods.
REDESCRIBE_CHANGE = 0.25
RANKS_PER_REDESCRIBE_WINDOW = 1024


# Recovery actions that stop and start the job's ranks (the controller posts them as they run).
_RESTARTS = frozenset(
    {schema.ActionKind.RESTART, schema.ActionKind.MIGRATE, schema.ActionKind.RESIZE}
)


class JobStream:
    """Rolling state of one job."""

    def __init__(self, job_id: str, cfg: config_mod.AnalyzerConfig, num_ranks: int = 0) -> None:
        self.cfg = cfg
        self.window = window_mod.StepWindow(job_id, cfg.stream_window_steps, num_ranks)
        self.hang = hangs.HangTracker(job_id, cfg.hang, names=self.window.names)
        self.hang.expect_ranks(range(num_ranks))
        self.open: dict[tuple[Kind, tuple[int, ...], tuple[str, ...]], schema.Finding] = {}
        self.job_done = False
        self._start_steps()

    def _start_steps(self) -> None:
        """The step analysis's state as at a job's first step (or a relaunched attempt's)."""
        self.analysed: list[int] = []  # chronological steps analysed and still in the window
        self.num_analysed = 0
        self.next_step = -1  # lowest step not yet analysed
        self.newest_step = -1
        self.flag_ring = {
            k: np.zeros((self.cfg.straggler.window, 0), dtype=bool) for k in stragglers.RANK_KINDS
        }
        self.hits = {k: np.zeros(0, dtype=np.int32) for k in stragglers.RANK_KINDS}
        # Whether each rank's current run of hits (an episode, as `robust.persistent_episodes`
        # has it) has been persistent (`stragglers.persistence_hits`): its hits can dip below
        # that and the episode go on.
        self.reached = {k: np.zeros(0, dtype=bool) for k in stragglers.RANK_KINDS}
        # Persistent ranks the last detection did not report (`_unreported`): retried.
        self.unreported = False
        # When each rank's current run of straggler flags began (NaN: none): an episode can
        # have begun before the window's first step, and a rank waiting for a CPU is reported
        # once its episode has lasted `min_cpu_wait_episode_s`.
        self.began = np.zeros(0)
        self.mfu_reported_step = -(10**9)
        self.mfu_series: list[float] = []
        self.mfu_steps: list[int] = []
        self.mfu_run = 0  # consecutive newest windows flagged as a drop
        # Drops found, not yet lasted `MfuConfig.min_drop_s`, with their baseline levels.
        self.mfu_pending: list[tuple[schema.Finding, float]] = []

    # --- feeding -----------------------------------------------------------------------
    def feed(
        self, batch: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> list[schema.Finding]:
        """One batch of this job's records; `steps`: all its step records as columns, if
        built (step records in `batch` are then skipped)."""
        step_records, agg_records, beats, others = aggcols.split(batch)
        if steps is None:
            steps = columns.from_records(step_records)
        newest_beat = 0.0
        if beats and any(type(r) is schema.Action for r in others):
            # A restart between heartbeats: their order decides which attempt each is from.
            for r in batch:
                if type(r) is schema.Heartbeat:
                    self.hang.observe_heartbeat(r)
                    newest_beat = max(newest_beat, r.time_s)
                elif type(r) in aggcols.OTHERS:
                    self._feed_other(r)
        else:
            for r in others:
                self._feed_other(r)
            if beats:
                beat_arrays = aggcols.beat_batch(beats, self.window.names)
                self.hang.observe_heartbeats(beats, beat_arrays)
                newest_beat = float(beat_arrays.time_s.max())
        aggs = self.window.agg_batch(agg_records)
        out: list[schema.Finding] = []
        relaunched = self.window.relaunched_at(steps)
        if not np.isnan(relaunched):  # the old attempt's step records first, then the new's
            # (the batch's aggregates all go with the new attempt's: the old processes' last
            # records come seconds before the new ones' first, so batches merged into one call
            # seldom hold both)
            began = steps.column("start_s") >= relaunched
            out.extend(self._add_steps(steps.take(~began), None))
            out.extend(self._new_attempt())
            steps = steps.take(began)
        out.extend(self._add_steps(steps, aggs))
        if newest_beat and not self.job_done:
            hang = self.hang.check(newest_beat)
            if hang is not None:
                out.append(hang)
        return out

    def _add_steps(
        self, steps: columns.StepColumns, aggs: aggcols.AggBatch | None
    ) -> list[schema.Finding]:
        """Add step records and aggregates to the window; analyse the steps that became ready."""
        out: list[schema.Finding] = []
        numbers = steps.column("step")
        if len(steps):  # analyse what the ring would overwrite before it moves on
            batch_newest = int(numbers.max())
            self._fit(steps.column("rank"), numbers)
            out.extend(self._analyse_ready(force_upto=batch_newest - self.window.capacity // 2))
        oldest = max(self.next_step, self.newest_step - self.window.capacity + 1, 0)
        latest_end = self.window.add_steps(steps, oldest)
        if aggs is not None:
            self.window.add_aggregates(aggs, oldest)
            # Sequence numbers only: an aggregate describes a finished step.
            self.hang.observe_seqs(aggs)
        if len(steps):
            self.newest_step = max(self.newest_step, batch_newest)
            if self.next_step < 0:
                self.next_step = int(numbers.min())
            # Progress is any step ending, whether or not its step has been analysed yet.
            self.hang.observe_progress(
                batch_newest, latest_end, float(steps.column("start_s").max())
            )
            self.hang.observe_step_ends(steps.column("rank"), steps.column("end_s"))
        out.extend(self._analyse_ready())
        return out

    def _new_attempt(self) -> list[schema.Finding]:
        """The job's ranks were relaunched and train again steps the window already analysed
        (`StepWindow.relaunched_at`: a restart resumed from a checkpoint, by vigil's controller
        or by the launcher itself). What the old attempt left is analysed; then the step
        analysis starts over, start-up included (`StragglerConfig.warmup_steps`), as a job's
        first steps: without it the new attempt's steps would be skipped until they passed
        the old attempt's newest. The old attempt's straggler and data-stall findings resolve
        (their processes are gone); hangs and crashes keep their own account of restarts
        (`HangTracker.restarting`)."""
        out = self._analyse_ready(force_upto=self.newest_step)
        if self.analysed:  # with no hits left, every open straggler finding is over
            for hits in self.hits.values():
                hits.fill(0)
            out.extend(self._close_finished())
        self._start_steps()
        self.window.clear_steps()
        self.hang.rewind()
        return out

    def _fit(self, ranks: npt.NDArray[np.float64], numbers: npt.NDArray[np.float64]) -> None:
        """Lengthen the window when one rank's batch spans more than a quarter of it
        (`BATCHES_HELD`), to the next power of two up to the limits above."""
        capacity = self.window.capacity
        if float(numbers.max()) - float(numbers.min()) < capacity // BATCHES_HELD:
            return  # no rank's span can be longer than the batch's
        _, inverse = np.unique(ranks, return_inverse=True)
        low = np.full(int(inverse.max()) + 1, np.inf)
        high = np.full(low.size, -np.inf)
        np.minimum.at(low, inverse, numbers)
        np.maximum.at(high, inverse, numbers)
        need = BATCHES_HELD * (int((high - low).max()) + 1)
        limit = min(MAX_WINDOW_STEPS, MAX_WINDOW_CELLS // max(self.window.expected, 1))
        if need > capacity and limit > capacity:
            self.window.lengthen(min(limit, 1 << (need - 1).bit_length()))

    def _feed_other(self, r: schema.Record) -> None:
        if isinstance(r, schema.Job):
            self.window.peak_flops = r.peak_flops
            self.window.stages = arrays_mod.stages_for_layout(r.layout, r.world_size)
            self.job_done = r.state in (schema.JobState.COMPLETED, schema.JobState.FAILED)
            self._expect(r.world_size)
        elif isinstance(r, schema.RankInfo):
            self.window.set_node(r.rank, r.node, r.device_uuid)
            self._expect(r.world_size)
        elif isinstance(r, schema.Sample) and r.rank >= 0:
            self.window.add_sample(r.rank, r.time_s, r.metric, r.value)
        elif (
            isinstance(r, schema.Action)
            and r.kind in _RESTARTS
            and r.state is schema.ActionState.RUNNING
        ):
            self.hang.restarting(r.start_s)

    def _expect(self, world_size: int) -> None:
        """Wait for `world_size` ranks: a step is not analysed before the ranks whose batches
        have not arrived yet report it (or the others move on without them)."""
        self.hang.expect_ranks(range(world_size))
        self.window.declared = max(self.window.declared, world_size)

    # --- analysis ----------------------------------------------------------------------
    def _ready(self, step: int, quorum: int, force_upto: int) -> bool:
        """All known ranks reported `step`; or nearly all moved `stream_step_lag` past it (a
        silent rank must not stall the others, a late shipment must not be analysed early);
        or the ring needs its row."""
        if step > self.newest_step:
            return False
        if step <= force_upto or step <= quorum - self.cfg.stream_step_lag:
            return True
        row = step % self.window.capacity
        return bool(
            self.window.row_step[row] == step and self.window.reported[row] >= self.window.expected
        )

    def _analyse_ready(self, force_upto: int = -1) -> list[schema.Finding]:
        """Analyse the steps that became ready, oldest first. Only steps the ring holds are
        visited (a jump in step numbers costs nothing): a step no rank reported is passed once
        it would be ready itself (the ranks moved on without it)."""
        ready: list[int] = []
        quorum = self.window.quorum_step()
        held = self.window.row_step
        for step in np.sort(held[held >= max(self.next_step, 0)]).tolist():
            if self.next_step < 0:
                break
            if step > self.next_step and not self._ready(step - 1, quorum, force_upto):
                break  # a step between the last analysed and this one may still come
            if not self._ready(step, quorum, force_upto):
                break
            self.next_step = step + 1
            if self.window.reported[step % self.window.capacity]:
                ready.append(step)
        if not ready:
            return []
        # Score all ready steps in one vectorised call: each step's row is smoothed over the
        # same earlier steps as when scored alone, so this equals scoring them one by one.
        # ... and each scale pooled over the same earlier rows (robust.robust_center_scale).
        cfg = self.cfg.straggler
        declared = self.window.rank_stages()
        stages = stragglers.stage_groups(declared)
        own = stragglers.compares_own_forward(declared, sends_p2p=self.window.sends_p2p())
        keep = stragglers.history_rows(self.window.num_ranks, stages, cfg, own_forward=own)
        history = self.analysed[-keep:] if keep > 0 else []
        recent = self.window.view([*history, *ready])
        scores = stragglers.score(recent, cfg, last=len(ready))
        rows = slice(len(history), None)
        with np.errstate(all="ignore"):
            medians = robust.nanmedian(recent.step_time_s[rows], 1).tolist()
        ends = recent.step_end_s[rows].tolist()
        starts = recent.step_start_s[rows].tolist()
        mfus = recent.step_mfu()[rows].tolist()
        out: list[schema.Finding] = []
        for i, step in enumerate(ready):
            step_scores = scores.rows(i, i + 1)
            out.extend(self._analyse(step, step_scores, medians[i], (starts[i], ends[i]), mfus[i]))
        return out

    def _analyse(
        self,
        step: int,
        scores: stragglers.Scores,
        median_time: float,
        span_s: tuple[float, float],
        job_mfu: float,
    ) -> list[schema.Finding]:
        self.analysed.append(step)
        self.num_analysed += 1
        if len(self.analysed) > self.window.capacity:
            del self.analysed[0]
        self.hang.observe_step_time(step, span_s[1], median_time, span_s[0])
        newly = self._update_hits(scores, span_s[0])
        out: list[schema.Finding] = []
        retry = self.unreported and self.num_analysed % self.retry_every() == 0
        if newly or retry:
            out.extend(self._detect_window())
            self.unreported = self._unreported()
        elif self.num_analysed % self.redescribe_every() == 0:
            out.extend(self._redescribe())
        out.extend(self._close_finished())
        out.extend(self._mfu(step, job_mfu, span_s[1]))
        if self.num_analysed % self.judge_every() == 0:
            out.extend(self._imbalance())
        return out

    def retry_every(self) -> int:
        """Steps between looks at a persistent rank detection did not report (`RETRY_STEPS`)."""
        ranks = max(self.window.num_ranks, 1)
        return min(RETRY_STEPS, -(-ranks // RANKS_PER_RETRY_STEP))

    def judge_every(self) -> int:
        """Steps between judgements of the window's links and stage/sequence imbalance: every
        step for up to `RANKS_PER_JUDGED_STEP` ranks, less often as a judgement costs more
        (~10 us a rank), at least once a persistence window."""
        ranks = max(self.window.num_ranks, 1)
        return min(self.cfg.straggler.window, -(-ranks // RANKS_PER_JUDGED_STEP))

    def _update_hits(self, scores: stragglers.Scores, start_s: float) -> bool:
        """Roll the persistence counts of the step that began at `start_s`; True when some rank
        just became persistent."""
        newly = False
        n = self.window.num_ranks
        slot = self.num_analysed % self.cfg.straggler.window
        for kind in stragglers.RANK_KINDS:
            ring, hits = self.flag_ring[kind], self.hits[kind]
            if ring.shape[1] < n:
                ring = np.pad(ring, ((0, 0), (0, n - ring.shape[1])))
                hits = np.pad(hits, (0, n - hits.size))
            flags = scores.flags(kind)[0, :n]
            if self.num_analysed <= self.cfg.straggler.warmup_steps:
                flags = np.zeros_like(flags)  # start-up (StragglerConfig.warmup_steps)
            need = stragglers.persistence_hits(kind, self.cfg.straggler)
            before = hits >= need
            quiet = hits == 0
            hits = hits - ring[slot] + flags
            ring[slot] = flags
            newly |= bool((~before & (hits >= need)).any())
            self.flag_ring[kind], self.hits[kind] = ring, hits
            reached = np.pad(self.reached[kind], (0, n - self.reached[kind].size))
            self.reached[kind] = (reached | (hits >= need)) & (hits > 0)
            if kind is Kind.STRAGGLER:  # a run of hits begins at its first flagged step
                if self.began.size < n:
                    self.began = np.pad(
                        self.began, (0, n - self.began.size), constant_values=np.nan
                    )
                self.began[quiet & (hits > 0)] = start_s
                self.began[hits == 0] = np.nan
        return newly

    def _window_episodes(self) -> list[schema.Finding]:
        """The straggler and data-stall findings of the window's episodes still going on."""
        a = self.window.view(self.analysed)
        # The window's first row is the job's (num_analysed - len(analysed))-th analysed step.
        warmup = self.cfg.straggler.warmup_steps - (self.num_analysed - len(self.analysed))
        found = stragglers.detect(a, self.cfg.straggler, warmup_rows=warmup, began_s=self.began)
        ended = self.analysed[-1] - self.cfg.straggler.window  # episodes ended in the window
        return [f for f in found if f.step_end >= ended]

    def _detect_window(self) -> list[schema.Finding]:
        out = []
        for finding in self._window_episodes():
            key = _key(finding)
            if key not in self.open:
                self.open[key] = finding
                out.append(finding)
        return out

    def redescribe_every(self) -> int:
        """Steps between re-descriptions of the open rank findings (`REDESCRIBE_CHANGE`)."""
        ranks = max(self.window.num_ranks, 1)
        return self.cfg.straggler.window * -(-ranks // RANKS_PER_REDESCRIBE_WINDOW)

    def _redescribe(self) -> list[schema.Finding]:
        """Open straggler and data-stall findings as the window now shows their episode, where
        that says something else (`says_more`): re-sent under their ids, with their first
        step, detection time and folded MFU evidence kept."""
        if not any(kind in stragglers.RANK_KINDS for kind, _, _ in self.open):
            return []
        out = []
        for fresh in self._window_episodes():
            key = _key(fresh)
            old = self.open.get(key)
            if old is None or not says_more(old, fresh):
                continue
            self.open[key] = carried(old, fresh)
            out.append(self.open[key])
        return out

    def _unreported(self) -> bool:
        """Whether a rank's episode has been persistent with no open finding of that kind. Its
        episode can fail a check of the finding's own and pass it steps later, as offline
        analysis of the whole run finds, also after its hits dipped below persistence: the
        median over the episode so far (`stragglers._moved_up`), which an intermittent
        straggler's first steps keep at the baseline, its slow steps' period
        (`excess.evident`), or a wait for a CPU that has not yet lasted
        `min_cpu_wait_episode_s`."""
        for kind in stragglers.RANK_KINDS:
            persistent = np.flatnonzero(self.reached[kind])
            if not persistent.size:
                continue
            reported = {
                self.window.column(rank)
                for (k, ranks, _nodes) in self.open
                if k is kind
                for rank in ranks
            }
            if not reported.issuperset(persistent.tolist()):
                return True
        return False

    def _close_finished(self) -> list[schema.Finding]:
        out = []
        for key, finding in list(self.open.items()):
            kind, ranks, _nodes = key
            hits = self.hits.get(kind)
            if hits is None or not ranks:
                continue
            cols = [self.window.column(r) for r in ranks]
            if not hits[cols].any() and not self._still_shifted(finding, cols):
                del self.open[key]
                last = self.analysed[-1] - self.cfg.straggler.window
                out.append(
                    msgspec.structs.replace(
                        finding,
                        state=schema.FindingState.RESOLVED,
                        step_end=max(finding.step_end, last),
                    )
                )
        return out

    def _still_shifted(self, finding: schema.Finding, cols: list[int]) -> bool:
        """Whether a shift finding's rank is still slow: its shift (of its forward time, of its
        time outside a pipeline schedule or in its backward passes) is measured against its own
        earlier steps, which come to hold the slow ones (`forward_shift.py`) and end its flags
        while the rank stays slow. It stays open while the rank's signal (its last
        `smooth_steps` steps' trimmed mean) keeps at least half its reported excess over its
        earlier level."""
        head = finding.evidence[0] if finding.evidence else None
        field = stragglers.OWN_FIELDS.get(head.metric) if head is not None else None
        if head is None or field is None or head.baseline is None:
            return False
        a = self.window.view(self.analysed[-self.cfg.straggler.smooth_steps :])
        values = getattr(a, field)
        if values is None:
            return False
        recent = robust.trimmed_mean_last(values[:, cols], self.cfg.straggler.smooth_steps)
        with np.errstate(invalid="ignore"):
            return bool(np.all(recent > head.baseline + 0.5 * (head.observed - head.baseline)))

    def _mfu(self, step: int, value: float, end_s: float) -> list[schema.Finding]:
        self.mfu_series.append(value)
        self.mfu_steps.append(step)
        keep = self.cfg.stream_window_steps
        del self.mfu_series[:-keep], self.mfu_steps[:-keep]
        # Test only the newest window each step; the whole series only when a run of flagged
        # windows just became long enough to be a drop (what find_drops would first report).
        span = self.cfg.mfu.baseline_steps + self.cfg.mfu.recent_steps
        if len(self.mfu_series) < span:
            return []
        newest = np.asarray(self.mfu_series[-span:], dtype=np.float64)
        flagged = mfu.newest_is_drop(newest, self.cfg.mfu)
        self.mfu_run = self.mfu_run + 1 if flagged else 0
        if self.mfu_run == self.cfg.mfu.recent_steps:
            drops = mfu.find_drops(np.asarray(self.mfu_series, dtype=np.float64), self.cfg.mfu)
            for drop in drops:
                change = self.mfu_steps[drop.change_row]
                if change < self.mfu_reported_step + self.cfg.mfu.baseline_steps or any(
                    held.step_start == change for held, _ in self.mfu_pending
                ):
                    continue
                a = self.window.view(self.analysed[-len(self.mfu_series) :])
                found = mfu.drop_finding(a, drop, mfu.headline_metric(a), self.cfg.mfu)
                self.mfu_pending.append((found, drop.before))
        # Each drop is held until it has lasted `min_drop_s` from its change point, and
        # dropped if it recovers first, as offline (`mfu.find_drops` with step times).
        out = []
        pending, self.mfu_pending = self.mfu_pending, []
        for found, level in pending:
            if not mfu.still_down(newest, level, self.cfg.mfu):
                continue
            if end_s - found.trace_start_s < self.cfg.mfu.min_drop_s:
                self.mfu_pending.append((found, level))
                continue
            self.mfu_reported_step = found.step_start
            out.append(self._fold(msgspec.structs.replace(found, detected_s=end_s)))
        return out

    def _fold(self, drop: schema.Finding) -> schema.Finding:
        """The drop, or the open straggler finding that explains it with the drop's evidence
        added (re-sent under its id: the collector upserts it)."""
        for key, finding in self.open.items():
            if mfu.explains(finding, drop, self.cfg.straggler.window):
                self.open[key] = mfu.folded(finding, drop)
                return self.open[key]
        return drop

    def _imbalance(self) -> list[schema.Finding]:
        a = self.window.view(self.analysed, with_transfers=True)
        out = []
        found = imbalance.stage_findings(a, self.cfg.straggler)
        found.extend(links.detect(a, self.cfg.straggler))
        seqlen = imbalance.seqlen_finding(a)
        for finding in [*found, *([seqlen] if seqlen else [])]:
            key = _key(finding)
            if key not in self.open:
                self.open[key] = finding
                out.append(finding)
        return out


def _key(f: schema.Finding) -> tuple[Kind, tuple[int, ...], tuple[str, ...]]:
    return (f.kind, tuple(f.subjects.ranks), tuple(f.subjects.nodes))


def says_more(old: schema.Finding, fresh: schema.Finding) -> bool:
    """Whether `fresh` describes the episode otherwise: another shape, a headline ratio
    `REDESCRIBE_CHANGE` away from the reported one, or the shape's own number as far (an
    intermittent straggler's count of slow steps, whose median stays what its usual steps look
    like; a growing one's latest excess share of the step)."""
    if shape.said(old.evidence) is not shape.said(fresh.evidence):
        return True
    before, now = old.evidence[0], fresh.evidence[0]
    if before.metric != now.metric or not before.baseline or not now.baseline:
        return before.metric != now.metric
    headline = _moved(before.observed / before.baseline, now.observed / now.baseline)
    return headline or _moved(_shape_number(old), _shape_number(fresh))


def _shape_number(f: schema.Finding) -> float | None:
    """The observed value of the finding's shape evidence (`shape.evidence`); None: steady."""
    metrics = (shape.SLOW_STEPS_METRIC, shape.TREND_METRIC)
    return next((float(e.observed) for e in f.evidence if e.metric in metrics), None)


def _moved(was: float | None, now: float | None) -> bool:
    """Whether `now` is `REDESCRIBE_CHANGE` of `was` away from it (None: no number)."""
    return was is not None and now is not None and abs(now - was) >= REDESCRIBE_CHANGE * abs(was)


def carried(old: schema.Finding, fresh: schema.Finding) -> schema.Finding:
    """`fresh` under `old`'s id, first step and detection time, with the MFU drop folded into
    `old` (`mfu.folded`), if any."""
    have = {e.metric for e in fresh.evidence}
    kept = [e for e in old.evidence if e.metric in mfu.METRICS and e.metric not in have]
    return msgspec.structs.replace(
        fresh,
        finding_id=old.finding_id,
        step_start=old.step_start,
        detected_s=old.detected_s,
        trace_start_s=old.trace_start_s,
        evidence=[*fresh.evidence, *kept][: schema.MAX_EVIDENCE],
    )
