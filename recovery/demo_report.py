"""The demo's verdict: one row per injected fault, computed from what vigil recorded (pure).

Inputs are the findings (from the collector), the controller's journal of actions, and rank 0's
per-step log (`vigil train --metrics-out`: step, attempt, end_s per line). No I/O beyond reading
that file; no processes, no network.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vigil.recovery.policy import RESTARTING
from vigil.schema import Action, ActionKind, ActionState, Finding, FindingKind

# The controller's diagnose result: "<node>: <verdict> (<detail>)[; cordoned]", "; "-joined.
_VERDICT = re.compile(r"(?:^|; )(\S+): (pass|suspect|fail|unknown)\b(?: \([^)]*\))?(; cordoned)?")
_KINDS = {"straggler": FindingKind.STRAGGLER, "hang": FindingKind.HANG, "crash": FindingKind.CRASH}
# The attempt each fault fires in: the demo chains them, one recovery each.
_ATTEMPT = {"straggler": 0, "hang": 1, "crash": 2}


@dataclass(frozen=True)
class FaultRow:
    fault: str
    detected_after_s: float | None
    culprit: str
    expected_culprit: str
    action: str
    recover_s: float | None
    steps_lost: int | None
    # The diagnose action's verdict per node ("node-1: pass"), "-" when none ran.
    diagnosis: str = "-"
    # Steps rank 0 ended between the onset and the finding: the evidence a finding waited for,
    # which (unlike seconds) a loaded host does not stretch.
    detected_after_steps: int | None = None

    @property
    def ok(self) -> bool:
        return (
            self.detected_after_s is not None
            and self.culprit == self.expected_culprit
            and self.recover_s is not None
            and self.steps_lost is not None
            and self.steps_lost <= 1
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a killed rank
    return rows


def build_rows(
    *,
    findings: Sequence[Finding],
    actions: Sequence[Action],
    steps_path: Path,
    plan_ranks: Mapping[str, int],
    fault_steps: Mapping[str, int],
) -> list[FaultRow]:
    steps = read_steps(steps_path)
    rows = []
    for fault, kind in _KINDS.items():
        attempt = _ATTEMPT[fault]
        onset = _onset(steps, attempt, fault_steps[fault])
        finding = _first_finding(findings, actions, kind, after=onset)
        expected = f"rank {plan_ranks[fault]}"
        if finding is None:
            rows.append(FaultRow(fault, None, "-", expected, "-", None, None))
            continue
        mine = sorted(
            (a for a in actions if a.finding_id == finding.finding_id), key=lambda a: a.action_id
        )
        restart = next((a for a in mine if a.kind in RESTARTING), None)
        recover_s, lost = _recovery(steps, attempt, fault_steps[fault], restart)
        diagnosed = [a for a in mine if a.kind is ActionKind.DIAGNOSE]
        rows.append(
            FaultRow(
                fault=fault,
                detected_after_s=None if onset is None else round(finding.detected_s - onset, 2),
                culprit=", ".join(f"rank {r}" for r in sorted(finding.subjects.ranks)) or "-",
                expected_culprit=expected,
                action="+".join(a.kind.value for a in mine) or "-",
                recover_s=recover_s,
                steps_lost=lost,
                diagnosis="; ".join(verdict_of(a) for a in diagnosed) or "-",
                detected_after_steps=_steps_between(steps, attempt, onset, finding.detected_s),
            )
        )
    return rows


def verdict_of(diagnose: Action) -> str:
    """A diagnose action's verdict per node ("node-1: pass; cordoned"), from its result."""
    if diagnose.state is ActionState.SKIPPED:
        return "skipped"
    if diagnose.state in (ActionState.PENDING, ActionState.RUNNING):
        return "not finished"
    parts = [
        f"{m.group(1)}: {m.group(2)}" + (", cordoned" if m.group(3) else "")
        for m in _VERDICT.finditer(diagnose.result)
    ]
    return "; ".join(parts) or diagnose.result[:60]


def _onset(steps: Sequence[Mapping[str, Any]], attempt: int, fault_step: int) -> float | None:
    """When the fault fired: the end of the step before it, in the attempt it fires in."""
    ends = [s["end_s"] for s in steps if s["attempt"] == attempt and s["step"] == fault_step - 1]
    return min(ends) if ends else None


def _steps_between(
    steps: Sequence[Mapping[str, Any]], attempt: int, start: float | None, end: float
) -> int | None:
    """How many of the attempt's steps ended after `start` and by `end`."""
    if start is None:
        return None
    return sum(1 for s in steps if s["attempt"] == attempt and start < s["end_s"] <= end)


def _first_finding(
    findings: Sequence[Finding], actions: Sequence[Action], kind: FindingKind, after: float | None
) -> Finding | None:
    """The finding of `kind` the controller acted on (else the first one after the onset)."""
    acted = {a.finding_id for a in actions}
    later = [f for f in findings if f.kind is kind and (after is None or f.detected_s >= after)]
    for finding in sorted(later, key=lambda f: f.detected_s):
        if finding.finding_id in acted:
            return finding
    return min(later, key=lambda f: f.detected_s, default=None)


def _recovery(
    steps: Sequence[Mapping[str, Any]], attempt: int, fault_step: int, restart: Action | None
) -> tuple[float | None, int | None]:
    """(seconds from the decision to the next attempt's first step, steps redone)."""
    if restart is None:
        return None, None
    nxt = [s for s in steps if s["attempt"] == attempt + 1]
    if not nxt:
        return None, None
    first = min(nxt, key=lambda s: s["end_s"])
    done_before = [s["step"] for s in steps if s["attempt"] == attempt]
    last_done = max(done_before, default=0)
    # Straggler: the job was healthy (only slow) when stopped; its last completed step counts.
    # Hang/crash: the faulty step never completed; the step before it is the last good one.
    last_good = min(last_done, fault_step - 1) if attempt else last_done
    lost = max(0, last_good - (first["step"] - 1))
    return round(first["end_s"] - restart.start_s, 2), lost
