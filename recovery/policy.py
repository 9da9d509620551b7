"""Recovery policy: a pure table from (finding kind, severity, context) to actions.

Pure by contract (import-linter, pyproject.toml): no web framework, database, Kubernetes client or
torch here. `decide` takes a finding and a snapshot of the job's situation and returns the planned
actions; executors carry them out and the controller records them. Budgets (restarts per hour and a
cool-down) keep a flapping node from putting a job into a restart loop.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vigil.schema import ActionKind, Finding, FindingKind


class Severity(enum.IntEnum):
    LOW = 1
    MEDIUM = 2
    HIGH = 3
    CRITICAL = 4


class Step(enum.StrEnum):
    """One row entry: what to do, before it is resolved against the context."""

    CHECKPOINT = "checkpoint"
    DUMP_STACKS = "dump_stacks"
    DIAGNOSE = "diagnose"
    CORDON = "cordon"
    RESTART = "restart"
    # Move the culprit nodes' ranks to spares; shrink data parallelism when no spare is left.
    RELOCATE = "relocate"


# Steps that stop the job's ranks, and so spend restart budget.
DISRUPTIVE = frozenset({Step.RESTART, Step.RELOCATE})

# The table. A missing row means "record the finding, do nothing".
TABLE: dict[tuple[FindingKind, Severity], tuple[Step, ...]] = {
    # A dead rank: the job is down already; restart from the newest state, away from a node
    # that keeps failing (the context's repeat count promotes RESTART to RELOCATE).
    (FindingKind.CRASH, Severity.CRITICAL): (Step.RESTART,),
    # A hung job cannot checkpoint: dump stacks for evidence, then restart from the newest state.
    (FindingKind.HANG, Severity.CRITICAL): (Step.DUMP_STACKS, Step.RESTART),
    # A broken or silently-wrong device: save what we can, fence the node off, move away from it.
    (FindingKind.NODE_FAULT, Severity.CRITICAL): (Step.CHECKPOINT, Step.CORDON, Step.RELOCATE),
    (FindingKind.SDC, Severity.CRITICAL): (Step.CHECKPOINT, Step.CORDON, Step.RELOCATE),
    # Stragglers: measure first; move only when the slowdown costs the whole job a lot.
    (FindingKind.STRAGGLER, Severity.LOW): (Step.DIAGNOSE,),
    (FindingKind.STRAGGLER, Severity.MEDIUM): (Step.DIAGNOSE,),
    (FindingKind.STRAGGLER, Severity.HIGH): (Step.CHECKPOINT, Step.DIAGNOSE, Step.RELOCATE),
    (FindingKind.SLOW_LINK, Severity.MEDIUM): (Step.DIAGNOSE,),
    (FindingKind.SLOW_LINK, Severity.HIGH): (Step.CHECKPOINT, Step.DIAGNOSE, Step.RELOCATE),
    (FindingKind.DATA_STALL, Severity.MEDIUM): (Step.DUMP_STACKS,),
    (FindingKind.DATA_STALL, Severity.HIGH): (Step.DUMP_STACKS,),
    (FindingKind.MFU_DROP, Severity.MEDIUM): (Step.DIAGNOSE,),
    (FindingKind.MFU_DROP, Severity.HIGH): (Step.DIAGNOSE,),
}

# Evidence that carries a slowdown: an explicit "slowdown" factor, or any time-like metric
# ("compute_time", "collective_time", ...) whose observed/baseline ratio is the factor.
SLOWDOWN_METRIC = "slowdown"
# 1.5x: the whole synchronous job runs at the straggler's pace, so a 50 % slower rank wastes a
# third of every GPU-hour; below 1.2x a migration's restart costs more than it saves.
HIGH_SLOWDOWN = 1.5
MEDIUM_SLOWDOWN = 1.2


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Limits on disruptive actions; the defaults suit jobs whose restart takes about a minute."""

    # Six restarts an hour lets a job ride out a bad node and a flaky link, not a crash loop.
    max_restarts_per_hour: int = 6
    # 60 s between restarts gives a restarted job time to show whether it is healthy.
    cooldown_s: float = 60.0
    # Findings below this confidence are recorded but not acted on.
    min_confidence: float = 0.5
    # A node that is the culprit this many times in the window is moved away from, not retried.
    relocate_after_repeats: int = 2

    def __post_init__(self) -> None:
        if self.max_restarts_per_hour < 0:
            raise ValueError("max_restarts_per_hour must be >= 0")
        if self.cooldown_s < 0 or not math.isfinite(self.cooldown_s):
            raise ValueError("cooldown_s must be a finite number >= 0")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError("min_confidence must be within [0, 1]")
        if self.relocate_after_repeats < 1:
            raise ValueError("relocate_after_repeats must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Context:
    """The job's situation when a finding arrives."""

    now_s: float
    restart_times_s: Sequence[float] = ()
    spare_nodes: int = 0
    dp_size: int = 1
    min_dp_size: int = 1
    # Nodes holding each data-parallel replica's ranks is executor detail; the policy only needs
    # how many replicas losing the culprit nodes would cost.
    replicas_per_node: int = 1
    # How often each node has been a culprit recently (the controller keeps this).
    culprit_counts: dict[str, int] = field(default_factory=dict)
    job_down: bool = False

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.min_dp_size < 1:
            raise ValueError("dp_size and min_dp_size must be >= 1")
        if self.spare_nodes < 0:
            raise ValueError("spare_nodes must be >= 0")


@dataclass(frozen=True)
class PlannedAction:
    kind: ActionKind
    target: str
    reason: str


@dataclass(frozen=True)
class Decision:
    actions: tuple[PlannedAction, ...]
    # Why disruptive steps were dropped (budget, cool-down, low confidence), or "".
    suppressed: str = ""
    # The job is down and may not be restarted: the controller must mark it failed.
    give_up: bool = False

    @property
    def restarts(self) -> bool:
        return any(a.kind in RESTARTING for a in self.actions)


# Actions that stop the job's ranks and start them again.
RESTARTING = frozenset({ActionKind.RESTART, ActionKind.MIGRATE, ActionKind.RESIZE})


def severity(finding: Finding) -> Severity:
    """How bad a finding is, from its kind and (for slowdowns) its evidence."""
    if finding.kind in (
        FindingKind.CRASH,
        FindingKind.HANG,
        FindingKind.NODE_FAULT,
        FindingKind.SDC,
    ):
        return Severity.CRITICAL
    slowdown = slowdown_factor(finding)
    if slowdown is not None:
        if slowdown >= HIGH_SLOWDOWN:
            return Severity.HIGH
        return Severity.MEDIUM if slowdown >= MEDIUM_SLOWDOWN else Severity.LOW
    if finding.kind in (FindingKind.DATA_STALL, FindingKind.MFU_DROP, FindingKind.SLOW_LINK):
        return Severity.MEDIUM
    return Severity.LOW


def slowdown_factor(finding: Finding) -> float | None:
    """How many times slower the culprit is, from the finding's evidence (None if unknown)."""
    factors = [e.observed for e in finding.evidence if e.metric == SLOWDOWN_METRIC]
    factors += [
        e.observed / e.baseline
        for e in finding.evidence
        if e.metric.endswith("_time") and e.baseline is not None and e.baseline > 0
    ]
    return max(factors, default=None)


def decide(finding: Finding, context: Context, budget: Budget | None = None) -> Decision:
    """Map one finding to the actions to take now."""
    budget = budget or Budget()
    steps = TABLE.get((finding.kind, severity(finding)), ())
    suppressed = ""
    if finding.confidence < budget.min_confidence and not context.job_down:
        kept = tuple(s for s in steps if s not in DISRUPTIVE and s is not Step.CORDON)
        if kept != steps:
            suppressed = (
                f"confidence {finding.confidence:.2f} is below {budget.min_confidence:.2f}: "
                "not disrupting the job"
            )
        steps = kept
    if any(s in DISRUPTIVE for s in steps):
        blocked = _budget_block(context, budget)
        if blocked:
            steps = tuple(s for s in steps if s not in DISRUPTIVE)
            suppressed = blocked
    nodes = sorted(set(finding.subjects.nodes))
    if (
        Step.RESTART in steps
        and nodes
        and any(
            context.culprit_counts.get(n, 0) + 1 >= budget.relocate_after_repeats for n in nodes
        )
    ):
        steps = tuple(Step.RELOCATE if s is Step.RESTART else s for s in steps)
    actions = tuple(a for s in steps for a in _resolve(s, finding, nodes, context))
    give_up = context.job_down and not any(a.kind in RESTARTING for a in actions)
    return Decision(actions=actions, suppressed=suppressed, give_up=give_up)


def _budget_block(context: Context, budget: Budget) -> str:
    recent = [t for t in context.restart_times_s if context.now_s - t < 3600.0]
    if len(recent) >= budget.max_restarts_per_hour:
        return (
            f"restart budget spent: {len(recent)} restarts in the last hour "
            f"(limit {budget.max_restarts_per_hour})"
        )
    if recent and context.now_s - max(recent) < budget.cooldown_s:
        since = context.now_s - max(recent)
        return (
            f"cooling down: last restart {since:.0f} s ago ({budget.cooldown_s - since:.0f} s left)"
        )
    return ""


def _targets(finding: Finding, nodes: list[str]) -> str:
    if nodes:
        return ",".join(nodes)
    if finding.subjects.ranks:
        return ",".join(f"rank{r}" for r in sorted(finding.subjects.ranks))
    return finding.job_id


def _resolve(
    step: Step, finding: Finding, nodes: list[str], context: Context
) -> tuple[PlannedAction, ...]:
    why = f"{finding.kind.value} {finding.finding_id}"
    if step is Step.CHECKPOINT:
        if context.job_down:
            return ()  # nothing alive to checkpoint; the newest snapshot is what we have
        return (PlannedAction(ActionKind.CHECKPOINT, finding.job_id, why),)
    if step is Step.DUMP_STACKS:
        return (PlannedAction(ActionKind.DUMP_STACKS, _targets(finding, nodes), why),)
    if step is Step.DIAGNOSE:
        return (PlannedAction(ActionKind.DIAGNOSE, _targets(finding, nodes), why),)
    if step is Step.CORDON:
        return tuple(PlannedAction(ActionKind.CORDON, n, why) for n in nodes)
    if step is Step.RESTART:
        return (PlannedAction(ActionKind.RESTART, finding.job_id, why),)
    return _relocate(finding, nodes, context, why)


def _relocate(
    finding: Finding, nodes: list[str], context: Context, why: str
) -> tuple[PlannedAction, ...]:
    if not nodes:  # culprit not pinned to a node: a plain restart is all we can do
        return (PlannedAction(ActionKind.RESTART, finding.job_id, why),)
    if context.spare_nodes >= len(nodes):
        return tuple(PlannedAction(ActionKind.MIGRATE, n, f"{why}: move to a spare") for n in nodes)
    lost = len(nodes) * context.replicas_per_node
    if context.dp_size - lost >= context.min_dp_size:
        return (
            PlannedAction(
                ActionKind.RESIZE,
                ",".join(nodes),
                f"{why}: no spare node; data parallel {context.dp_size} -> "
                f"{context.dp_size - lost}",
            ),
        )
    return (
        PlannedAction(
            ActionKind.RESTART,
            finding.job_id,
            f"{why}: no spare and data parallel already at its minimum; restarting in place",
        ),
    )


def culprit_nodes(findings: Sequence[Finding]) -> dict[str, int]:
    """How often each node was a culprit across `findings` (for Context.culprit_counts)."""
    counts: dict[str, int] = {}
    for finding in findings:
        for node in set(finding.subjects.nodes):
            counts[node] = counts.get(node, 0) + 1
    return counts


__all__ = [
    "RESTARTING",
    "TABLE",
    "Budget",
    "Context",
    "Decision",
    "PlannedAction",
    "Severity",
    "Step",
    "culprit_nodes",
    "decide",
    "severity",
    "slowdown_factor",
]
