"""Offline analysis of whole runs: every detector over a job's arrays and records.

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
from vigil.analyzer import hangs, imbalance, mfu, stragglers

log = logging.getLogger(__name__)


def analyze_arrays(
    a: arrays_mod.StepArrays, cfg: config_mod.AnalyzerConfig | None = None
) -> list[schema.Finding]:
    """Stragglers, stalls, links, imbalance and MFU drops of one job's completed steps."""
    cfg = cfg or config_mod.AnalyzerConfig()
    out = stragglers.detect(a, cfg.straggler)
    out.extend(imbalance.stage_findings(a, cfg.straggler))
    seqlen = imbalance.seqlen_finding(a)
    if seqlen is not None:
        out.append(seqlen)
    out.extend(mfu.detect(a, cfg.mfu))
    return out


def replay_hang(
    a: arrays_mod.StepArrays,
    records: Iterable[schema.Record],
    now_s: float,
    cfg: config_mod.HangConfig,
) -> schema.Finding | None:
    """Feed progress and positions to a hang tracker and check it once at `now_s`."""
    tracker = hangs.HangTracker(a.job_id, cfg)
    with np.errstate(all="ignore"):
        step_time = np.nanmedian(a.step_time_s, axis=1)
    for i in range(a.num_steps):
        if np.isfinite(a.step_end_s[i]):
            tracker.observe_step_time(int(a.steps[i]), float(a.step_end_s[i]), float(step_time[i]))
    positions = sorted(
        (r for r in records if isinstance(r, schema.Heartbeat | schema.CollectiveAggregate)),
        key=_position_time,
    )
    for record in positions:
        if isinstance(record, schema.Heartbeat):
            tracker.observe_heartbeat(record)
        else:
            tracker.observe_seq(record.rank, record.group, record.last_seq, record.op)
    return tracker.check(now_s)


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
    records: Iterable[schema.Record], cfg: config_mod.AnalyzerConfig | None = None
) -> list[schema.Finding]:
    """Every finding over a mix of records of one or more jobs (e.g. a folder of SDK JSONL)."""
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
        hang = replay_hang(a, job_records, newest_time_s(merged), cfg.hang)
        if hang is not None:
            out.append(hang)
    return out
