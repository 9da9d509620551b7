"""What the recovery controller reads and writes through: where findings come from
(`FindingSource`), how a job is asked to checkpoint and what that came to (`Checkpointer`,
`CheckpointOutcome`), where its actions are recorded (`ActionSink`) and where the ranks' steps
stand (`StepWatch`). Protocols and one value type; implementations live with their transports
(`collector_link`, `checkpoint_request`, `attempts`). No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vigil.recovery import attempts
from vigil.schema import Action, DiagResult, Finding


class FindingSource(Protocol):
    def fetch(self) -> Sequence[Finding]:
        """Findings about the job seen since the last call (repeats are ignored by id)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointOutcome:
    """What one "checkpoint now" came to: how many ranks took the request, and the checkpoint
    committed after it (an acknowledgement says only that a rank saw the request)."""

    # Ranks that acknowledged, of the ranks asked (0 asked: no rank of the job is known).
    acked: int = 0
    asked: int = 0
    # The step of a checkpoint committed after the request (None: none seen in time).
    committed_step: int | None = None
    location: str = ""
    # False: this channel cannot see commits (acknowledgements are all it knows).
    tracked: bool = True
    # Why the request never reached the job ("" = it was posted).
    error: str = ""

    @property
    def committed(self) -> bool:
        return self.committed_step is not None

    def describe(self, timeout_s: float) -> str:
        """The action's result: exactly what was seen, e.g. "requested, acknowledged by 4 of 4
        ranks, committed at step 12 (/ckpt/step-12)"."""
        if self.error:
            return f"not requested: {self.error}"
        if not self.asked:
            return "requested, but no rank of the job is known to answer it: nothing awaited"
        parts = ["requested"]
        if self.acked:
            parts.append(f"acknowledged by {self.acked} of {self.asked} ranks")
        else:
            parts.append(f"not acknowledged within {timeout_s:.0f} s")
        if self.committed:
            where = f" ({self.location})" if self.location else ""
            parts.append(f"committed at step {self.committed_step}{where}")
        elif not self.tracked:
            parts.append("commits are not tracked on this channel: not known to have committed")
        else:
            parts.append(f"no commit seen within {timeout_s:.0f} s")
        return ", ".join(parts)


class Checkpointer(Protocol):
    def request(self, *, timeout_s: float) -> CheckpointOutcome:
        """Ask the running job to checkpoint now and wait (at most `timeout_s`) for evidence
        that a checkpoint committed after the request."""


class ActionSink(Protocol):
    def publish(self, record: Action | Finding | DiagResult) -> None:
        """Record an action's new state, a finding the controller made itself (a crash) or a
        diagnosed node's result somewhere people can see it (the collector, a JSONL file)."""

    def replay(self) -> bool:
        """Send again what could not be sent before; False while that still fails."""


class StepWatch(Protocol):
    """Where the ranks' steps stand (`attempts.ProgressWatch` reads the SDK's pages and files)."""

    def last_steps(self, attempt: int, since_s: float) -> dict[int, int]:
        """Each rank's newest step finished in `attempt` (started at `since_s`)."""

    def first_step(self, attempt: int, since_s: float) -> attempts.FirstStep | None:
        """The lowest step `attempt` finished, once one has."""

    def forget(self) -> None:
        """Drop what was read for the attempt awaited so far."""
