"""The streaming analyzer the collector calls after each committed batch (`StreamAnalyzer` hook).

`StreamingAnalyzer.observe(records)` routes each batch to its job's rolling state (keyed by
`record.job_id`; `jobstream.JobStream`: a window of recent steps x ranks, per-rank persistence
counts, a hang tracker and the job's open findings), starting a new job's from the store's
history when the collector has one (a restarted collector picks up running jobs), and forgets jobs
idle for `stream_job_idle_s` or beyond `stream_max_jobs`. `tick(now_s)` checks for hangs when no
records arrive. Findings are returned with stable ids (re-sent when resolved or re-described);
the collector upserts them. Pure: no I/O, no clocks, no threads; not thread-safe (the collector
calls it from one task).
"""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from vigil import columns, schema
from vigil.analyzer import config as config_mod
from vigil.analyzer import jobstream

log = logging.getLogger(__name__)


def _before(
    past: tuple[Sequence[schema.Record], columns.StepColumns | None],
    batch: Sequence[schema.Record],
    steps: columns.StepColumns | None,
) -> tuple[Sequence[schema.Record], columns.StepColumns | None]:
    """History without the steps the batch itself carries (already stored when the history
    was read): a step's aggregates must not be counted twice."""
    firsts = [int(steps.column("step").min())] if steps is not None and len(steps) else []
    firsts += [
        r.step for r in batch if isinstance(r, schema.StepRecord | schema.CollectiveAggregate)
    ]
    if not firsts:
        return past
    first = min(firsts)
    records = [
        r
        for r in past[0]
        if not isinstance(r, schema.StepRecord | schema.CollectiveAggregate) or r.step < first
    ]
    cols = past[1]
    if cols is not None and len(cols):
        keep = cols.column("step") < first
        cols = columns.StepColumns(
            values=cols.values[keep],
            job_ids=[j for j, k in zip(cols.job_ids, keep.tolist(), strict=True) if k],
            loss=None if cols.loss is None else cols.loss[keep],
        )
    return records, cols


# The record types the analyzer reads (Findings, Actions, Checkpoints and DiagResults are not
# measurements of the job's progress).
_MEASURED = frozenset(
    {
        schema.StepRecord,
        schema.CollectiveAggregate,
        schema.Heartbeat,
        schema.Sample,
        schema.Job,
        schema.RankInfo,
    }
)


_JOB_ID = operator.attrgetter("job_id")
# `history(job_id, steps)`: a job's Job and RankInfo records and its last `steps` steps' step
# records (as columns) and collective aggregates, from the store.
History = Callable[[str, int], tuple[Sequence[schema.Record], columns.StepColumns | None]]
# Besides measurements, the analyzer reads the recovery actions that restart a job.
_READ = _MEASURED | {schema.Action}


class StreamingAnalyzer:
    """Implements the collector's `StreamAnalyzer` protocol; see the module docstring."""

    def __init__(
        self,
        config: config_mod.AnalyzerConfig | None = None,
        *,
        history: History | None = None,
    ) -> None:
        self.config = config or config_mod.AnalyzerConfig()
        # The collector may hand over several batches as one call when together they span at
        # most this many steps of a job (`MergingAnalyzer`): a quarter of the ring, so a call
        # never forces its own steps to be analysed before they are in (`jobstream.JobStream.feed`).
        self.merge_steps = max(1, self.config.stream_window_steps // 4)
        # Least recently seen first; each job's value: its stream and the tick time it was last
        # seen at (jobs idle past `stream_job_idle_s` are forgotten on tick).
        self._jobs: OrderedDict[str, jobstream.JobStream] = OrderedDict()
        self._seen_s: dict[str, float] = {}
        self._now_s = 0.0
        self._history = history
        self.forgotten = 0  # jobs dropped for idleness or to stay within stream_max_jobs

    def use_history(self, history: History) -> None:
        """Read each new job's recent past through `history` (the collector's store)."""
        self._history = history

    def job_ids(self) -> list[str]:
        return sorted(self._jobs)

    def observe(
        self, records: Sequence[schema.Record], steps: columns.StepColumns | None = None
    ) -> Sequence[schema.Finding]:
        """Take one committed batch (any record types; `steps`: all its step records as
        columns, when the caller built them: step records in `records` are then skipped);
        return new or updated findings."""
        by_job: Mapping[str, Sequence[schema.Record]]
        try:
            jobs = set(map(_JOB_ID, records))
        except AttributeError:  # a record type without a job (DiagResult)
            jobs = {getattr(r, "job_id", "") for r in records}
        if steps is not None:
            jobs |= steps.jobs()
        jobs.discard("")
        if len(jobs) == 1:  # the common case: one sender's batch (feed skips other types)
            by_job = {jobs.pop(): records}
        else:
            grouped: dict[str, list[schema.Record]] = {job: [] for job in sorted(jobs)}
            for record in records:
                job = getattr(record, "job_id", "")
                if job and type(record) in _READ:
                    grouped[job].append(record)
            by_job = grouped
        out: list[schema.Finding] = []
        for job, batch in by_job.items():
            job_steps = None if steps is None else steps.of_job(job)
            stream = self._jobs.get(job)
            measured = any(type(r) in _MEASURED for r in batch)
            if stream is None and not measured and not (job_steps is not None and len(job_steps)):
                continue  # e.g. only findings or actions about a job not seen yet
            if stream is None:
                stream = self._start(job, batch, job_steps, out)
            self._jobs.move_to_end(job)
            self._seen_s[job] = self._now_s
            try:
                out.extend(stream.feed(batch, job_steps))
            except (ValueError, IndexError) as exc:  # bad data for one job must not stop others
                log.warning("job %s: batch skipped by the analyzer: %s", job, exc)
        return out

    def _start(
        self,
        job: str,
        batch: Sequence[schema.Record],
        steps: columns.StepColumns | None,
        out: list[schema.Finding],
    ) -> jobstream.JobStream:
        """A new job's stream: its recent past from `history` when there is one (a collector
        that restarted picks up running jobs where the store has them), then the batch."""
        world = next((r.world_size for r in batch if isinstance(r, schema.Job)), 0)
        past: tuple[Sequence[schema.Record], columns.StepColumns | None] = ([], None)
        if self._history is not None:
            try:
                past = self._history(job, self.config.stream_window_steps)
            except Exception as exc:  # the store is down: start from what arrives
                log.warning("job %s: no history for the analyzer: %s", job, exc)
        world = max(
            [world, *(r.world_size for r in past[0] if isinstance(r, schema.Job | schema.RankInfo))]
        )
        stream = self._jobs[job] = jobstream.JobStream(job, self.config, world)
        while len(self._jobs) > self.config.stream_max_jobs:
            self._forget(next(iter(self._jobs)))
        past = _before(past, batch, steps)
        if past[0] or (past[1] is not None and len(past[1])):
            try:
                # Findings already stored are re-sent with the same ids; the store upserts them.
                out.extend(stream.feed(past[0], past[1]))
            except (ValueError, IndexError) as exc:
                log.warning("job %s: history skipped by the analyzer: %s", job, exc)
        return stream

    def _forget(self, job: str) -> None:
        self._jobs.pop(job, None)
        self._seen_s.pop(job, None)
        self.forgotten += 1

    def tick(self, now_s: float) -> list[schema.Finding]:
        """Check every job for a hang at `now_s` (call about once a second); forget jobs idle
        for longer than `stream_job_idle_s`."""
        self._now_s = now_s
        idle = [
            job
            for job, seen in self._seen_s.items()
            if seen and now_s - seen > self.config.stream_job_idle_s
        ]
        for job in idle:
            self._forget(job)
        for job in self._jobs:  # seen before the first tick: idle from now on
            if not self._seen_s.get(job):
                self._seen_s[job] = now_s
        out = []
        for stream in self._jobs.values():
            if stream.job_done:
                continue
            finding = stream.hang.check(now_s)
            if finding is not None:
                out.append(finding)
        return out

    def due_s(self) -> float | None:
        """The earliest time a tick could find a hang in some job (`HangTracker.due_s`)."""
        due = [s.hang.due_s() for s in self._jobs.values() if not s.job_done]
        return min((d for d in due if d is not None), default=None)

    def forget(self, job_id: str) -> None:
        """Drop a finished job's state."""
        self._jobs.pop(job_id, None)
        self._seen_s.pop(job_id, None)


__all__ = ["StreamingAnalyzer"]
