"""A job's attempts, as `vigil analyze` shows them: each attempt's steps, the crash that ended it,
the restart that followed (resume step, steps lost, time to recover) and what else the
controller did (pure).

Inputs are the records read from a job's folder, each with the attempt its file holds
(`rank-NNNNN.attempt-A.jsonl`; untagged files are attempt 0), and the controller's record
(`controller.jsonl`: its crash findings and its actions, each action's newest state kept).
`latest_steps` keeps, of a step trained in several attempts, the newest attempt's records: the
detectors see the run as finally trained, while the attempts keep what was lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vigil import schema

_RESTARTING = frozenset(
    {schema.ActionKind.RESTART, schema.ActionKind.MIGRATE, schema.ActionKind.RESIZE}
)


@dataclass(frozen=True, kw_only=True)
class Attempt:
    job_id: str
    attempt: int
    ranks: int  # ranks with step records
    first_step: int  # -1: no step records in this attempt
    last_step: int
    start_s: float
    end_s: float
    # The restart action that launched this attempt (None for the first start, or unknown).
    restart: schema.Action | None = None
    # The crash finding that ended it (the controller's), if it ended in one.
    crash: schema.Finding | None = None
    # The controller's other actions while this attempt ran (checkpoint, diagnose, ...).
    actions: tuple[schema.Action, ...] = field(default_factory=tuple)


def latest_steps(tagged: Sequence[tuple[int, schema.Record]]) -> list[schema.Record]:
    """The records with, for each (job, rank, step) of step records and aggregates, only those
    of the newest attempt that trained it; other records pass unchanged."""
    newest: dict[tuple[str, int, int], int] = {}
    for attempt, record in tagged:
        key = _step_key(record)
        if key is not None:
            newest[key] = max(newest.get(key, attempt), attempt)
    out = []
    for attempt, record in tagged:
        key = _step_key(record)
        if key is None or newest[key] == attempt:
            out.append(record)
    return out


def _step_key(record: schema.Record) -> tuple[str, int, int] | None:
    if isinstance(record, schema.StepRecord | schema.CollectiveAggregate):
        return (record.job_id, record.rank, record.step)
    return None


def final_actions(records: Iterable[schema.Record]) -> list[schema.Action]:
    """Each action's newest state (an action is recorded at each state change)."""
    by_id: dict[str, schema.Action] = {}
    for record in records:
        if isinstance(record, schema.Action):
            by_id[record.action_id] = record
    return list(by_id.values())


def summarize(
    tagged: Sequence[tuple[int, schema.Record]],
    actions: Sequence[schema.Action],
    findings: Sequence[schema.Finding],
) -> list[Attempt]:
    """Every attempt of every job that had a restart or a crash on record, in order."""
    spans: dict[tuple[str, int], list[schema.StepRecord]] = {}
    for attempt, record in tagged:
        if isinstance(record, schema.StepRecord):
            spans.setdefault((record.job_id, attempt), []).append(record)
    restarts = {
        (a.job_id, a.attempt): a
        for a in actions
        if a.kind in _RESTARTING and a.attempt >= 0 and a.state is schema.ActionState.SUCCEEDED
    }
    crashes = {f.finding_id: f for f in findings if f.kind is schema.FindingKind.CRASH}
    jobs = (
        {job for job, _ in spans}
        | {a.job_id for a in actions}
        | {f.job_id for f in crashes.values()}
    )
    out: list[Attempt] = []
    for job in sorted(jobs):
        found = {n for j, n in spans if j == job} | {n for j, n in restarts if j == job}
        job_crashes = [f for f in crashes.values() if f.job_id == job]
        if not found - {0} and not job_crashes:
            continue  # one attempt and nothing happened to it: no section
        numbers = sorted(found | {0})
        job_actions = sorted(
            (a for a in actions if a.job_id == job and a.kind not in _RESTARTING),
            key=lambda a: (a.start_s, a.action_id),
        )
        linked = {r.finding_id for (j, _), r in restarts.items() if j == job}
        starts = {n: _start(restarts.get((job, n)), spans.get((job, n), [])) for n in numbers}
        for i, n in enumerate(numbers):
            steps = spans.get((job, n), [])
            after = restarts.get((job, n + 1))
            ending = after.finding_id if after is not None else None
            crash = crashes.get(ending or "") or next(
                (f for f in job_crashes if _attempt_of(f) == n), None
            )
            ending = ending or (crash.finding_id if crash is not None else None)
            until = starts[numbers[i + 1]] if i + 1 < len(numbers) else float("inf")
            mine = tuple(
                a
                for a in job_actions
                if a.finding_id == ending
                or (a.finding_id not in linked and starts[n] <= (a.start_s or a.end_s) < until)
            )
            out.append(
                Attempt(
                    job_id=job,
                    attempt=n,
                    ranks=len({s.rank for s in steps}),
                    first_step=min((s.step for s in steps), default=-1),
                    last_step=max((s.step for s in steps), default=-1),
                    start_s=starts[n],
                    end_s=max((s.end_s for s in steps), default=starts[n]),
                    restart=restarts.get((job, n)),
                    crash=crash,
                    actions=mine,
                )
            )
    return out


def _start(restart: schema.Action | None, steps: Sequence[schema.StepRecord]) -> float:
    """When an attempt began: its restart's relaunch, else its first step's start."""
    if restart is not None and restart.end_s > 0:
        return restart.end_s
    return min((s.start_s for s in steps), default=0.0)


def _attempt_of(finding: schema.Finding) -> int:
    """The attempt a controller crash finding names (its id ends `-a<attempt>-r<rank>`)."""
    head, _, rank = finding.finding_id.rpartition("-r")
    _, _, number = head.rpartition("-a")
    return int(number) if number.isdigit() and rank.isdigit() else -1


def lines(attempts: Sequence[Attempt], findings: Sequence[schema.Finding]) -> list[str]:
    """The text report's attempts section (empty when there is nothing to say)."""
    if not attempts:
        return []
    detected = {f.finding_id: f.detected_s for f in findings}
    out = ["", f"Attempts ({len(attempts)}):"]
    for a in attempts:
        steps = f"steps {a.first_step}-{a.last_step}" if a.first_step >= 0 else "no steps"
        ranks = f" on {a.ranks} rank(s)" if a.ranks else ""
        out.append(f"  attempt {a.attempt} of {a.job_id}: {steps}{ranks}")
        if a.restart is not None:
            out.append(f"      {_restart_text(a.restart, detected)}")
        for action in a.actions:
            out.append(f"      {action.kind.value} {action.state.value}: {action.result[:200]}")
        if a.crash is not None:
            out.append(f"      crash: {a.crash.summary}")
    return out


def _restart_text(restart: schema.Action, detected: dict[str, float]) -> str:
    text = f"started by {restart.kind.value} ({restart.result[:120]})"
    if restart.resume_step >= 0:
        text += f"; resumed at step {restart.resume_step}"
        if restart.steps_lost >= 0:
            text += f", {restart.steps_lost} step(s) lost"
            if restart.steps_lost:
                redone = restart.resume_step + restart.steps_lost - 1
                text += f" (steps {restart.resume_step}-{redone} trained again)"
        when = detected.get(restart.finding_id)
        if restart.recovered_s > 0 and when:
            text += f"; recovered {restart.recovered_s - when:.1f} s after the failure was found"
    else:
        text += "; its first step is not on record"
    return text


def to_dicts(attempts: Sequence[Attempt]) -> list[dict[str, object]]:
    return [
        {
            "job_id": a.job_id,
            "attempt": a.attempt,
            "ranks": a.ranks,
            "first_step": a.first_step,
            "last_step": a.last_step,
            "start_s": a.start_s,
            "end_s": a.end_s,
            "restart": None
            if a.restart is None
            else {
                "action_id": a.restart.action_id,
                "kind": a.restart.kind.value,
                "finding_id": a.restart.finding_id,
                "resume_step": a.restart.resume_step,
                "steps_lost": a.restart.steps_lost,
                "recovered_s": a.restart.recovered_s,
                "result": a.restart.result,
            },
            "crash": None
            if a.crash is None
            else {
                "finding_id": a.crash.finding_id,
                "summary": a.crash.summary,
                "ranks": a.crash.subjects.ranks,
                "step": a.crash.step_start,
                "exit_code": next(
                    (int(e.observed) for e in a.crash.evidence if e.metric == "exit_code"), None
                ),
            },
            "actions": [
                {"kind": x.kind.value, "state": x.state.value, "result": x.result}
                for x in a.actions
            ],
        }
        for a in attempts
    ]
