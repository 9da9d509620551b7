"""Stand-ins for the controller's seams: an executor that implements the `Executor` protocol and
nothing more (scripted rank exits and diagnostics), a step watch and a recording sink."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vigil.recovery.attempts import FirstStep
from vigil.recovery.executor import RankExit
from vigil.recovery.placement import Placement
from vigil.schema import Action, DiagResult, Finding


@dataclass
class FakeExecutor:
    """Ranks that run until `script` says otherwise: `script(attempt, polls)` returns the exits
    of that poll (all ranks exiting 0 ends the job)."""

    script: Callable[[int, int], list[RankExit]]
    diagnostics: dict[str, list[DiagResult]] = field(default_factory=dict)
    launched: list[tuple[int, Placement]] = field(default_factory=list)
    cordoned: list[str] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)
    diagnosed: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    _polls: int = 0
    _alive: list[int] = field(default_factory=list)

    def launch(self, placement: Placement, attempt: int) -> None:
        self.calls.append("launch")
        bad = [n for n in placement.active if n in self.cordoned]
        if bad:
            raise ValueError(f"node {bad[0]} is cordoned and cannot run ranks")
        self.launched.append((attempt, placement))
        self._alive = list(range(placement.world_size))
        self._polls = 0

    def adopt(self, placement: Placement, attempt: int) -> int:
        self.calls.append("adopt")
        return 0

    def kill_attempt(self, attempt: int) -> None:
        self.calls.append("kill_attempt")

    def poll(self) -> list[RankExit]:
        self._polls += 1
        exits = self.script(self.launched[-1][0], self._polls)
        ended = {e.rank for e in exits}
        self._alive = [r for r in self._alive if r not in ended]
        return exits

    def alive(self) -> list[int]:
        return list(self._alive)

    def stop(self, *, timeout_s: float) -> None:
        self.calls.append("stop")
        self._alive = []

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        return {r: "" for r in ranks}

    def diagnose(self, node: str, *, timeout_s: float) -> list[DiagResult]:
        self.diagnosed.append(node)
        if node not in self.diagnostics:
            raise RuntimeError(f"diagnostics of {node} failed (exit 3, 0 results): boom")
        return self.diagnostics[node]

    def cordon(self, node: str) -> None:
        self.cordoned.append(node)

    def forget_node(self, node: str, job: str) -> None:
        self.forgotten.append(node)


@dataclass
class FakeWatch:
    """Per attempt: each rank's last finished step, and its first step (after `delay` polls)."""

    last: dict[int, dict[int, int]] = field(default_factory=dict)
    first: dict[int, FirstStep] = field(default_factory=dict)
    delay: int = 2
    asked: list[int] = field(default_factory=list)

    def last_steps(self, attempt: int, since_s: float) -> dict[int, int]:
        return dict(self.last.get(attempt, {}))

    def first_step(self, attempt: int, since_s: float) -> FirstStep | None:
        self.asked.append(attempt)
        if self.asked.count(attempt) <= self.delay:
            return None
        return self.first.get(attempt)

    def forget(self) -> None:
        pass


@dataclass
class Recorder:
    records: list[Action | Finding | DiagResult] = field(default_factory=list)
    replays: int = 0

    def publish(self, record: Action | Finding | DiagResult) -> None:
        self.records.append(record)

    def replay(self) -> bool:
        self.replays += 1
        return True

    def actions(self, action_id: str) -> list[Action]:
        return [r for r in self.records if isinstance(r, Action) and r.action_id == action_id]
