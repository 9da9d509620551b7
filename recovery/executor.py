"""The executor interface: what the controller needs from whatever runs the ranks.

The local supervisor (`vigil.recovery.local`) implements it with processes on this host; a
Kubernetes executor implements the same methods with pods. The controller never touches processes
or pods directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vigil.recovery.placement import Placement


@dataclass(frozen=True)
class RankExit:
    """A rank that ended: its exit code (negative: killed by that signal) and when it was seen."""

    rank: int
    node: str
    returncode: int
    seen_s: float


class Executor(Protocol):
    def launch(self, placement: Placement, attempt: int) -> None:
        """Start every rank of `placement` for restart attempt `attempt` (0 = first start)."""

    def poll(self) -> list[RankExit]:
        """Ranks that ended since the last poll, in the order they were seen."""

    def alive(self) -> list[int]:
        """Ranks still running."""

    def stop(self, *, timeout_s: float) -> None:
        """Stop every rank: ask politely, then kill after `timeout_s`."""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Python stacks of the given ranks (py-spy; empty text where unavailable)."""

    def cordon(self, node: str) -> None:
        """Never schedule onto `node` again."""

    def forget_node(self, node: str, job: str) -> None:
        """The job moved away from `node`: drop whatever of the job's state it held."""
