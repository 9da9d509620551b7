"""Whole-run analysis of what is already in memory: every detector over a job's records or arrays.

`offline` finds and reads the files (`vigil analyze PATH`) and hands their records here; tests
and benchmarks call it directly; `streaming` runs the same detectors over its window instead.
`analyze_arrays` runs the array detectors (stragglers, data stalls, slow links, stage and
sequence-length imbalance, MFU drops); `analyze_records` groups records by job, builds the arrays
and also replays progress and heartbeats through the hang tracker, taking "now" as the newest
time any record carries. Pure: no I/O.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from vigil import schema
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import hangs, imbalance, links, mfu, stragglers

log = logging.getLogger(__name__)


def analyze_arrays(
    a: arrays_mod.StepArrays, cfg: config_mod.AnalyzerConfig | None = None
) -> list[schema.Finding]:
    """Stragglers, stalls, links, imbalance and MFU drops of one job's completed steps."""
    cfg = cfg or config_mod.AnalyzerConfig()
    out = stragglers.detect(a, cfg.straggler)
    out.extend(links.detect(a, cfg.straggler))
    out.extend(imbalance.stage_findings(a, cfg.straggler))
    seqlen = imbalance.seqlen_finding(a)
    if seqlen is not None:
        out.append(seqlen)
    out.extend(mfu.detect(a, cfg.mfu))
    # A drop blamed on a straggler found above is that straggler's evidence, not a finding.
    return mfu.fold(out, cfg.straggler.window)


def replay_hang(
    a: arrays_mod.StepArrays,
    records: Iterable[schema.Record],
    now_s: float,
    cfg: config_mod.HangConfig,
) -> list[schema.Finding]:
    """Replay progress and positions through a hang tracker in time order, checking it as the
    streaming analyzer's ticks would (at each heartbeat, at most every `_CHECK_EVERY_S`, and
    just after the silence passes the threshold: `HangTracker.due_s`) and at `now_s`: a hang
    the job came out of is found too. Returns each hang finding once, in its final state."""
    tracker = hangs.HangTracker(a.job_id, cfg)
    tracker.expect_ranks(a.ranks.tolist())
    with np.errstate(all="ignore"):
        step_time = np.nanmedian(a.step_time_s, axis=1)
    step_end = {int(s): float(e) for s, e in zip(a.steps, a.step_end_s, strict=True)}
    events: list[tuple[float, int, int, schema.Record | None]] = [
        (float(a.step_end_s[i]), 0, i, None)
        for i in range(a.num_steps)
        if np.isfinite(a.step_end_s[i])
    ]
    ends: dict[int, tuple[list[int], list[float]]] = {}  # step -> its ranks' own step ends
    for r in records:
        if isinstance(r, schema.StepRecord):
            ranks_ends = ends.setdefault(r.step, ([], []))
            ranks_ends[0].append(r.rank)
            ranks_ends[1].append(r.end_s)
        elif isinstance(r, schema.Heartbeat):
            events.append((r.time_s, 2, 0, r))
        elif isinstance(r, schema.CollectiveAggregate):
            # An aggregate describes a finished step: its position is known when it ends.
            events.append((step_end.get(r.step, -1.0), 1, 0, r))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    found: dict[str, schema.Finding] = {}
    checked = -np.inf
    due: float | None = None  # the tracker's `due_s`, asked after each step's end and check
    for time_s, kind, i, record in events:
        if due is not None and checked < due < time_s:
            checked = due
            _keep(found, tracker.check(due))
            due = tracker.due_s()
        if kind == 0:
            tracker.observe_step_time(
                int(a.steps[i]), time_s, float(step_time[i]), float(a.step_start_s[i])
            )
            # Every rank's end of this step is at or before the latest (signs of life).
            tracker.observe_step_ends(*ends.get(int(a.steps[i]), ([], [])))
            due = tracker.due_s()
        elif isinstance(record, schema.CollectiveAggregate):
            tracker.observe_seq(record.rank, record.group, record.last_seq, record.op)
        elif isinstance(record, schema.Heartbeat):
            tracker.observe_heartbeat(record)
            if time_s - checked >= _CHECK_EVERY_S:
                checked = time_s
                _keep(found, tracker.check(time_s))
                due = tracker.due_s()
    _keep(found, tracker.check(now_s, final=True))
    return list(found.values())


# The streaming analyzer's tick: how often the replay asks the tracker.
_CHECK_EVERY_S = 0.5


def _keep(found: dict[str, schema.Finding], finding: schema.Finding | None) -> None:
    if finding is not None:
        found[finding.finding_id] = finding


def _position_time(record: schema.Heartbeat | schema.CollectiveAggregate) -> tuple[float, int]:
    if isinstance(record, schema.Heartbeat):
        return (record.time_s, 1)
    return (-1.0, record.step)  # aggregates describe completed steps: before any later heartbeat


def newest_time_s(records: Iterable[schema.Record]) -> float:
    """The latest instant any record speaks of: the offline stand-in for "now"."""
    newest = 0.0
    for r in records:
        if isinstance(r, schema.Heartbeat | schema.Sample):
            newest = max(newest, r.time_s)
        elif isinstance(r, schema.StepRecord):
            newest = max(newest, r.end_s)
    return newest


def analyze_records(
    records: Iterable[schema.Record],
    cfg: config_mod.AnalyzerConfig | None = None,
    *,
    replay: bool = True,
) -> list[schema.Finding]:
    """Every finding over a mix of records of one or more jobs (e.g. a folder of SDK JSONL);
    `replay=False`: the array detectors only (the caller replays hangs and crashes itself, per
    attempt: `replay_attempts`)."""
    cfg = cfg or config_mod.AnalyzerConfig()
    by_job: dict[str, list[schema.Record]] = defaultdict(list)
    samples: list[schema.Record] = []
    for record in records:
        job = getattr(record, "job_id", "")
        if isinstance(record, schema.Sample) and not job:
            samples.append(record)
        elif job:
            by_job[job].append(record)
    out: list[schema.Finding] = []
    for job, job_records in sorted(by_job.items()):
        if not any(isinstance(r, schema.StepRecord) for r in job_records):
            log.info("job %s has no step records; skipped", job)
            continue
        merged = job_records + samples
        a = arrays_mod.from_records(merged, job_id=job)
        out.extend(analyze_arrays(a, cfg))
        if replay:
            out.extend(replay_hang(a, job_records, newest_time_s(merged), cfg.hang))
    return out


def replay_attempts(
    tagged: Iterable[tuple[int, schema.Record]], cfg: config_mod.AnalyzerConfig | None = None
) -> list[schema.Finding]:
    """Hangs and crashes of a restarted job, each attempt replayed on its own (`tagged`:
    (attempt, record) pairs): a new attempt's ranks count their steps and collectives from
    scratch, and the crash that ended one attempt says nothing of the next."""
    cfg = cfg or config_mod.AnalyzerConfig()
    by_attempt: dict[tuple[str, int], list[schema.Record]] = defaultdict(list)
    for attempt, record in tagged:
        job = getattr(record, "job_id", "")
        if job and not isinstance(record, schema.Finding | schema.Action):
            by_attempt[(job, attempt)].append(record)
    out: list[schema.Finding] = []
    for (job, _), records in sorted(by_attempt.items()):
        if any(isinstance(r, schema.StepRecord) for r in records):
            a = arrays_mod.from_records(records, job_id=job)
            out.extend(replay_hang(a, records, newest_time_s(records), cfg.hang))
    return out
