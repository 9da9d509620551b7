"""The executor interface: everything the controller needs from whatever runs the ranks.

The local supervisor (`vigil.recovery.local`) implements it with processes on this host; a
Kubernetes executor implements the same methods with pods (one pod per rank or per node, a Job for
node diagnostics). The controller reaches ranks, nodes and their state only through these methods
(tests/recovery/test_executor_seam.py keeps it so), never processes or pods directly.

What an implementation must guarantee:
- Attempts are numbered from 0 (the first start); `launch(placement, n)` starts attempt n and
  gives every rank `n` as its restart count (VIGIL_RESTART_COUNT) and a rendezvous address no
  earlier attempt used.
- `adopt` and `kill_attempt` work from durable records the executor keeps itself (pid files
  locally; pod labels on Kubernetes), so a controller that was killed and started again can take
  over, or clear away, what its predecessor launched.
- `poll` reports each rank's end once, with its exit code (negative: the signal that killed it)
  and when it ended; a rank that cannot start (command missing) reports exit 2, which the
  controller never restarts.
- `diagnose` runs the node diagnostics (`vigil.kernels`, quick suite) ON the named node, on the
  devices that node's ranks use, and returns their results; it raises when they could not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vigil.recovery.placement import Placement
from vigil.schema import DiagResult


@dataclass(frozen=True)
class RankExit:
    """A rank that ended: its exit code (negative: killed by that signal) and when it was seen."""

    rank: int
    node: str
    returncode: int
    seen_s: float


class Executor(Protocol):
    def launch(self, placement: Placement, attempt: int) -> None:
        """Start every rank of `placement` for restart attempt `attempt` (0 = first start).

        Refuses (ValueError) a placement with an active node it has cordoned."""

    def adopt(self, placement: Placement, attempt: int) -> int:
        """Take over the ranks a previous controller started for `attempt`; how many it had
        started. Fewer than the world size means that launch was cut short: the caller kills
        the attempt (`kill_attempt`) and launches it again, never joins it."""

    def kill_attempt(self, attempt: int) -> None:
        """Kill whatever is still running of `attempt`, including ranks a previous controller
        started (found from the executor's own records, not from memory)."""

    def poll(self) -> list[RankExit]:
        """Ranks that ended since the last poll, in the order they were seen."""

    def alive(self) -> list[int]:
        """Ranks still running."""

    def stop(self, *, timeout_s: float) -> None:
        """Stop every rank: ask politely, then kill after `timeout_s`."""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Python stacks of the given ranks (py-spy; empty text where unavailable)."""

    def diagnose(self, node: str, *, timeout_s: float) -> list[DiagResult]:
        """Run the quick node diagnostics on `node` (its ranks' devices) and return each result
        (with its verdict). Raises RuntimeError when they could not run or did not finish within
        `timeout_s`."""

    def cordon(self, node: str) -> None:
        """Never schedule onto `node` again."""

    def forget_node(self, node: str, job: str) -> None:
        """The job moved away from `node`: drop whatever of the job's state it held."""
