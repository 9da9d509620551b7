"""The controller's journal kept in annotations on the job it recovers, not on a local disk.

A controller pod can be replaced at any moment (node drained, OOM, a roll-out); its successor
must find what was planned and done. `AnnotationJournal` is a `Journal` whose actions (each
action's latest state, keyed by id) and controller state live as two JSON annotations on the
JobSet, written through an `AnnotationStore` (`vigil.recovery.kubernetes` implements it with a
merge patch of those keys alone, retried on 409/429). Each `record`/`save_state` returns only
once the API server has accepted the write. Stack dumps still go to a scratch folder
(`run_dir`): they are evidence for people, not state. No `kubernetes` import here.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from vigil.recovery import k8s_plan
from vigil.recovery.journal import ControllerState, Journal
from vigil.schema import Action

log = logging.getLogger(__name__)
# The API server caps all of an object's annotations at 256 KiB together; keep well inside it.
MAX_JOURNAL_BYTES = 192 * 1024


class AnnotationStore(Protocol):
    def read(self) -> dict[str, str]:
        """The object's annotations now."""

    def write(self, changes: dict[str, str]) -> None:
        """Set these annotations (others untouched); returns once the server accepted them."""


@dataclass
class MemoryStore:
    """Annotations kept in memory: observe mode's journal, which must change nothing."""

    values: dict[str, str] = field(default_factory=dict)

    def read(self) -> dict[str, str]:
        return dict(self.values)

    def write(self, changes: dict[str, str]) -> None:
        self.values.update(changes)


class AnnotationJournal(Journal):
    def __init__(self, store: AnnotationStore, run_dir: Path | None = None) -> None:
        self.store = store
        self._actions_raw: dict[str, object] = {}
        super().__init__(run_dir or Path(tempfile.mkdtemp(prefix="vigil-k8s-")))

    def _load(self) -> None:
        text = self.store.read().get(k8s_plan.JOURNAL_ACTIONS, "")
        if not text:
            return
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(
                f"journal annotation {k8s_plan.JOURNAL_ACTIONS} is corrupt: {exc}"
            ) from exc
        for action_id, value in raw.items():
            self._actions_raw[action_id] = value
            self._actions[action_id] = msgspec.convert(value, Action)

    def record(self, action: Action) -> None:
        self._actions_raw[action.action_id] = msgspec.to_builtins(action)
        text = json.dumps(self._actions_raw, separators=(",", ":"), sort_keys=True)
        if len(text) > MAX_JOURNAL_BYTES:
            # Oldest finished recoveries go first: the collector keeps the full record.
            for old in sorted(self._actions_raw)[: len(self._actions_raw) // 2]:
                if old != action.action_id and self._actions[old].state.value in (
                    "succeeded",
                    "failed",
                    "skipped",
                ):
                    del self._actions_raw[old]
            text = json.dumps(self._actions_raw, separators=(",", ":"), sort_keys=True)
        self.store.write({k8s_plan.JOURNAL_ACTIONS: text})
        self._actions[action.action_id] = action

    def load_state(self) -> ControllerState | None:
        text = self.store.read().get(k8s_plan.JOURNAL_STATE, "")
        if not text:
            return None
        try:
            return msgspec.json.decode(text, type=ControllerState)
        except msgspec.DecodeError as exc:
            raise ValueError(f"controller state annotation is corrupt: {exc}") from exc

    def save_state(self, state: ControllerState) -> None:
        self.store.write({k8s_plan.JOURNAL_STATE: msgspec.json.encode(state).decode()})
