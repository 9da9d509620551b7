"""Whether the Kubernetes executor may change the cluster, and the advise mode's approvals.

Every write `k8s_executor.KubernetesExecutor` makes (quarantine, eviction, suspend and patch,
a diagnostics Job) first passes `guard`: `act` in an allowed namespace goes ahead; `advise`
posts the change as a `proposed` Action through the executor's `approvals` and goes ahead once
a person approved it (unapproved within `approval_timeout_s`: `NotActingError`); everything
else (observe mode, a namespace not allowed, a job lacking the preconditions) raises
`NotActingError` before any request. No API calls here and no `kubernetes` import.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from vigil.schema import Action, ActionKind, ActionState

log = logging.getLogger(__name__)

MODES = ("observe", "advise", "act")


class NotActingError(RuntimeError):
    """The executor may not change the cluster for this job (mode, namespace, preconditions)."""


class BreakerOpenError(RuntimeError):
    """The quarantine circuit breaker refused one more node: stop and report."""


class StayError(NotActingError):
    """No restart is possible that would help (the culprit's node is quarantined, no spare is
    free and the job cannot shrink): the job stays on its nodes; the message says why."""


class Approver(Protocol):
    def approved(self, proposal: Action, *, timeout_s: float) -> bool:
        """Post `proposal` (once) and wait for a person's approval; True once approved."""


class StackChannel(Protocol):
    def stacks(self, ranks: Sequence[int], *, timeout_s: float) -> dict[int, str]:
        """Each answering rank's own stack dump (`collector_link.CollectorControl`)."""


class Guarded(Protocol):
    """What `guard` reads from the executor."""

    mode: str
    namespace: str
    jobset: str
    job_id: str
    allowed_namespaces: frozenset[str]
    approvals: Approver | None
    approval_timeout_s: float

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def problems(self) -> list[str]: ...

    @property
    def generation(self) -> int: ...


def acting(ex: Guarded) -> bool:
    """Changes may be made: `act` (or `advise`, once approved) in an allowed namespace."""
    return (
        ex.mode in ("act", "advise") and ex.namespace in ex.allowed_namespaces and not ex.problems
    )


def guard(ex: Guarded, what: str, kind: ActionKind, target: str) -> None:
    """Return when `what` may be done now; NotActingError (nothing changed) otherwise."""
    if acting(ex) and ex.mode == "act":
        return
    if acting(ex):  # advise: a person approves each change through the collector
        _await_approval(ex, what, kind, target)
        return
    why = (
        "; ".join(ex.problems)
        if ex.problems
        else f"namespace {ex.namespace} is not allowed to act"
        if ex.mode != "observe"
        else "observe mode"
    )
    raise NotActingError(f"would {what} ({why}): nothing changed")


def _await_approval(ex: Guarded, what: str, kind: ActionKind, target: str) -> None:
    if ex.approvals is None:
        raise NotActingError(f"would {what} (advise mode needs a collector): nothing changed")
    # Stable across controller restarts: the same change of the same generation is proposed
    # once, and an approval given to a predecessor holds.
    digest = hashlib.sha1(what.encode(), usedforsecurity=False).hexdigest()[:10]
    job = ex.job_id or ex.jobset
    proposal = Action(
        action_id=f"{job}-proposal-{kind.value}-g{ex.generation}-{digest}",
        kind=kind,
        job_id=job,
        target=target,
        state=ActionState.PROPOSED,
        start_s=ex.clock(),
        result=f"vigil proposes to {what}; approve: POST /api/v1/actions/<id>/approve",
    )
    log.warning("advise mode: proposed %s (%s); waiting for approval", proposal.action_id, what)
    if not ex.approvals.approved(proposal, timeout_s=ex.approval_timeout_s):
        raise NotActingError(
            f"would {what} (advise mode: not approved within "
            f"{ex.approval_timeout_s:.0f} s as {proposal.action_id}): nothing changed"
        )
    log.warning("advise mode: %s approved; carrying it out", proposal.action_id)
