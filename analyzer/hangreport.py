"""The hang finding: what a stalled job's tracker says, in words and evidence.

`hang_finding` turns what `hangs.HangTracker` knows of a stall (`Stall`) and the culprits the
wait-for graph named (`waitgraph.Culprits`, or None) into the finding: who never entered which
collective of which group, or which ranks desynced, and where the culprits are (compiling,
between steps in the loop's own code, finished, late to report). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vigil import schema
from vigil.analyzer import crashes, findings, groups
from vigil.analyzer.waitgraph import Culprits


@dataclass(frozen=True, kw_only=True)
class Stall:
    """A stalled job as its tracker sees it when it reports the stall."""

    job_id: str
    now_s: float
    silent_s: float  # since the last progress
    threshold_s: float
    median_step_s: float
    last_step: int
    last_progress_s: float
    seqs: dict[str, dict[int, int]]  # group -> rank -> last sequence number entered
    waiting: int  # ranks that say they wait in a collective
    outside: set[int]  # ranks between steps, computing there
    compiling: set[int]
    finished: set[int]


def hang_finding(stall: Stall, culprits: Culprits | None, late: Sequence[int]) -> schema.Finding:
    """The hang finding (`late`: culprits whose newest heartbeat predates the stall)."""
    ev = [
        findings.evidence(
            "seconds_without_progress",
            stall.silent_s,
            stall.threshold_s,
            unit="s",
            note="baseline = learned hang threshold",
        ),
        findings.evidence("median_step_time", stall.median_step_s, unit="s"),
    ]
    if culprits is None:
        subjects, summary, confidence = schema.Subjects(), _unknown(stall), 0.5
    else:
        subjects = schema.Subjects(ranks=list(culprits.ranks))
        entered = [stall.seqs.get(culprits.group, {}).get(r, -1) for r in culprits.ranks]
        ev.append(
            findings.evidence(
                "culprit_last_seq", min(entered), culprits.seq, note=f"group {culprits.group}"
            )
        )
        ev.append(findings.evidence("ranks_waiting", culprits.num_waiting))
        summary = _named(stall, culprits, late)
        confidence = 0.95 if culprits.resolved and not late else 0.6
    return findings.make_finding(
        kind=schema.FindingKind.HANG,
        job_id=stall.job_id,
        subjects=subjects,
        step_start=stall.last_step + 1,
        step_end=stall.last_step + 1,
        summary=summary,
        evidence=ev,
        confidence=confidence,
        detected_s=stall.now_s,
        trace_start_s=stall.last_progress_s,
        trace_end_s=stall.now_s,
    )


def _unknown(stall: Stall) -> str:
    waiting = (
        f"{stall.waiting} rank(s) wait in collectives every member entered"
        if stall.waiting
        else "no rank reported waiting in a collective"
    )
    summary = (
        f"no step finished for {stall.silent_s:.1f} s (threshold {stall.threshold_s:.1f} s); "
        f"{waiting}, culprit unknown"
    )
    if stall.outside:
        summary += f"; {len(stall.outside)} rank(s) between steps"
    return summary


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + ("..." if len(ranks) > 8 else "")


def _named(stall: Stall, culprits: Culprits, late: Sequence[int]) -> str:
    members = sorted(stall.seqs.get(culprits.group, {}))
    where = f"group {culprits.group!r}, {groups.describe(culprits.group, members)}"
    silence = f"{stall.silent_s:.1f} s (threshold {stall.threshold_s:.1f} s)"
    if culprits.desync:
        variants = "; ".join(f"rank(s) {_ranks(r)} entered {op}" for op, r in culprits.desync)
        summary = (
            f"hang: collective desync at #{culprits.seq} of {where}: {variants} (the ranks "
            "called different collectives: a rank that left its loop early on uneven data, a "
            f"rank-dependent branch); no progress for {silence}"
        )
    else:
        summary = (
            f"hang: rank(s) {_ranks(culprits.ranks)} never entered "
            f"{culprits.op or 'collective'} #{culprits.seq} of {where}, that "
            f"{culprits.num_waiting} rank(s) wait in; no progress for {silence}"
        )
    notes = (
        (stall.compiling, "compiling"),
        (
            stall.outside,
            "between steps, in the training loop's own code (a save, an evaluation, a data "
            "loader outside any span)",
        ),
        (stall.finished, f"finished: {crashes.LEFT_LOOP}"),
    )
    for flagged, note in notes:
        those = [r for r in culprits.ranks if r in flagged]
        if those:
            summary += f"; rank(s) {_ranks(those)} {note}"
    if late:
        summary += (
            f"; rank(s) {_ranks(late)} sent no heartbeat since progress stopped, or since a peer "
            "entered that collective (their positions may be stale)"
        )
    return summary
