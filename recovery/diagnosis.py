"""Node diagnoses in the background: the controller's `diagnose` actions, run off its loop.

A quick suite takes seconds on a CPU and about a minute on a GPU node; the controller must keep
watching the job meanwhile (a crash during a diagnosis is still seen within a poll), and a
relocation planned after the diagnosis must not wait for it. `Diagnoses.start` runs the
executor's `diagnose` for each target node on a thread of its own; the controller collects the
finished ones (`finished`, `wait`) on its own thread, where it records them, so the journal and
the placement are only ever touched there. Verdicts: `worst_verdict` and `describe`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from vigil.recovery.executor import Executor
from vigil.schema import Action, DiagResult, Verdict

log = logging.getLogger(__name__)

_ORDER = (Verdict.FAIL, Verdict.SUSPECT, Verdict.PASS, Verdict.UNKNOWN)


def worst_verdict(results: Sequence[DiagResult]) -> Verdict:
    """The node's verdict: its worst result's (fail > suspect > pass); unknown when no result
    was judged (no baseline or spec to judge it by)."""
    seen = {r.verdict for r in results}
    return next((v for v in _ORDER if v in seen), Verdict.UNKNOWN)


def describe(node: str, results: Sequence[DiagResult]) -> str:
    """ "node-1: fail (11 results: 1 fail, 10 unknown; memtest.failing_words 12 count)"."""
    verdict = worst_verdict(results)
    counts = {v: sum(r.verdict is v for r in results) for v in Verdict}
    text = ", ".join(f"{n} {v.value}" for v, n in counts.items() if n)
    judged = verdict in (Verdict.FAIL, Verdict.SUSPECT)
    bad = [r for r in results if judged and r.verdict is verdict]
    named = "; ".join(f"{r.test} {r.value:g} {r.unit}".rstrip() for r in bad[:3])
    detail = f"{len(results)} results: {text}" + (f"; {named}" if named else "")
    return f"{node}: {verdict.value} ({detail})"


@dataclass
class Outcome:
    """A finished diagnosis: per node, its results, or why they could not be had."""

    action: Action
    start_s: float
    results: dict[str, list[DiagResult] | str] = field(default_factory=dict)


@dataclass
class _Running:
    outcome: Outcome
    thread: threading.Thread


@dataclass
class Diagnoses:
    executor: Executor
    timeout_s: float
    _running: dict[str, _Running] = field(default_factory=dict)

    def start(self, action: Action, nodes: Sequence[str], start_s: float) -> None:
        """Diagnose `nodes` for `action` in the background (once: a running one is kept)."""
        if action.action_id in self._running:
            return
        outcome = Outcome(action=action, start_s=start_s)
        thread = threading.Thread(
            target=self._run,
            args=(outcome, list(nodes)),
            name=f"vigil-diagnose-{action.target}",
            daemon=True,
        )
        self._running[action.action_id] = _Running(outcome, thread)
        thread.start()

    def _run(self, outcome: Outcome, nodes: list[str]) -> None:
        for node in nodes:
            try:
                outcome.results[node] = self.executor.diagnose(node, timeout_s=self.timeout_s)
            except Exception as exc:  # recorded as the node's result; never kills the thread
                log.warning("diagnosing %s failed: %s", node, exc)
                # RuntimeError is the protocol's "could not run": its message says why.
                expected = type(exc) is RuntimeError
                outcome.results[node] = str(exc) if expected else f"{type(exc).__name__}: {exc}"

    def running(self) -> list[str]:
        return sorted(self._running)

    def finished(self) -> list[Outcome]:
        """The diagnoses that ended since the last call."""
        done = [k for k, r in self._running.items() if not r.thread.is_alive()]
        return [self._running.pop(k).outcome for k in done]

    def wait(self, timeout_s: float) -> list[Outcome]:
        """Wait up to `timeout_s` for the running ones; those that ended."""
        for running in list(self._running.values()):
            running.thread.join(timeout=timeout_s)
        return self.finished()
