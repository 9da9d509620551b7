"""Building `vigil.schema.Finding` records with stable ids, shared by every detector.

A finding's id is derived from what it is about (job, kind, subjects, first step), so the
streaming analyzer can re-send an updated finding and the collector upserts it, and an offline
run over the same files yields the same ids. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from vigil import schema

_SUMMARY_CHARS = 4096  # schema.LongText


def finding_id(job_id: str, kind: schema.FindingKind, subjects: schema.Subjects, step: int) -> str:
    """A stable id: the same episode of the same fault on the same subjects gets the same id.

    Ranks identify the subjects; node and device names only when no rank is named, so a finding
    keeps its id whether or not the job's RankInfo records had arrived when it was raised.
    """
    who = ",".join(map(str, subjects.ranks)) or ",".join([*subjects.nodes, *subjects.devices])
    key = "|".join((job_id, str(kind), who, ",".join(subjects.links), str(step)))
    digest = hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()[:20]
    return f"{kind}-{digest}"


def make_finding(
    *,
    kind: schema.FindingKind,
    job_id: str,
    subjects: schema.Subjects,
    step_start: int = -1,
    step_end: int = -1,
    summary: str,
    evidence: Sequence[schema.Evidence],
    confidence: float,
    detected_s: float = 0.0,
    trace_start_s: float = 0.0,
    trace_end_s: float = 0.0,
    state: schema.FindingState = schema.FindingState.OPEN,
) -> schema.Finding:
    """A Finding with a stable id and its confidence clamped to [0, 1]; subjects, evidence and
    summary cut to the wire's bounds (`schema.MAX_SUBJECTS`, ...), so it always travels."""
    limit = schema.MAX_SUBJECTS
    sizes = (len(subjects.ranks), len(subjects.nodes), len(subjects.devices), len(subjects.links))
    if max(sizes) > limit:
        subjects = schema.Subjects(
            ranks=subjects.ranks[:limit],
            nodes=subjects.nodes[:limit],
            devices=subjects.devices[:limit],
            links=subjects.links[:limit],
        )
    if len(summary) > _SUMMARY_CHARS:
        summary = summary[: _SUMMARY_CHARS - 1] + "…"
    return schema.Finding(
        finding_id=finding_id(job_id, kind, subjects, step_start),
        kind=kind,
        job_id=job_id,
        subjects=subjects,
        step_start=step_start,
        step_end=step_end,
        summary=summary,
        evidence=list(evidence[: schema.MAX_EVIDENCE]),
        confidence=min(1.0, max(0.0, float(confidence))),
        detected_s=max(0.0, detected_s),
        state=state,
        trace_start_s=max(0.0, trace_start_s),
        trace_end_s=max(0.0, trace_end_s),
    )


def evidence(
    metric: str, observed: float, baseline: float | None = None, *, unit: str = "", note: str = ""
) -> schema.Evidence:
    """One number that moved; floats are rounded to 6 significant digits for readable reports."""
    return schema.Evidence(
        metric=metric,
        observed=float(f"{observed:.6g}"),
        baseline=None if baseline is None else float(f"{baseline:.6g}"),
        unit=unit,
        note=note,
    )


def confidence_from_z(z: float, hits: int, window: int) -> float:
    """Confidence grows with the outlier's strength and how persistently it was seen."""
    strength = min(1.0, max(0.0, (z - 2.0) / 8.0))
    persistence = min(1.0, hits / max(1, window))
    return round(0.5 + 0.25 * strength + 0.24 * persistence, 3)
