"""The controller's durable memory: an action journal and a state file, both crash-safe.

Actions are appended as JSON lines (vigil.codec) and fsync'd before the controller acts on them;
the state file (attempt, placement, restart history) is replaced atomically. A controller that is
killed and restarted reads both back and finishes what it started, exactly once. `RecordLog`
keeps the controller's record for `vigil analyze` (its findings, actions and diagnostics as SDK
JSON lines in the job's output folder); `Tee` gives a record to several sinks. Files only: no
processes, no network.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from vigil import codec
from vigil.recovery import ports
from vigil.schema import Action, ActionState, DiagResult, Finding

log = logging.getLogger(__name__)

FINAL_STATES = frozenset({ActionState.SUCCEEDED, ActionState.FAILED, ActionState.SKIPPED})


class ControllerState(msgspec.Struct, kw_only=True):
    """What a restarted controller needs to carry on."""

    run_id: str
    attempt: int = 0
    active: list[str] = msgspec.field(default_factory=list)
    spares: list[str] = msgspec.field(default_factory=list)
    cordoned: list[str] = msgspec.field(default_factory=list)
    ranks_per_node: int = 1
    restart_times_s: list[float] = msgspec.field(default_factory=list)
    # When the current attempt was launched: findings about earlier attempts are stale.
    attempt_started_s: float = 0.0
    culprit_counts: dict[str, int] = msgspec.field(default_factory=dict)
    handled_findings: list[str] = msgspec.field(default_factory=list)
    # Set while a recovery is under way: the finding being handled.
    recovering: str = ""
    # The attempt that was running when that recovery began (a restart launches this + 1).
    recovering_from: int = 0
    # Whether that recovery may stop the ranks gracefully (SIGTERM, wait) or must kill them.
    recovering_graceful: bool = True
    finished: bool = False
    exit_code: int = 0
    # The newest step any rank of the failed attempt had finished (None: not known).
    failed_last_step: int | None = None
    # The restart action waiting for its attempt's first step ("" when none).
    awaiting_first_step: str = ""


@dataclass
class Journal:
    run_dir: Path
    _actions: dict[str, Action] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._load()

    @property
    def actions_path(self) -> Path:
        return self.run_dir / "actions.jsonl"

    @property
    def state_path(self) -> Path:
        return self.run_dir / "state.json"

    def _load(self) -> None:
        if not self.actions_path.exists():
            return
        with self.actions_path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    # The controller died mid-write: the record never took effect.
                    log.warning("journal: ignoring a torn last line (%d)", number)
                    break
                record = codec.decode_json(line)
                if isinstance(record, Action):
                    self._actions[record.action_id] = record

    def get(self, action_id: str) -> Action | None:
        return self._actions.get(action_id)

    def actions(self) -> list[Action]:
        return list(self._actions.values())

    def record(self, action: Action) -> None:
        """Append `action` (its latest state) durably before returning."""
        with self.actions_path.open("ab") as f:
            f.write(codec.encode_json(action) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self._actions[action.action_id] = action

    def load_state(self) -> ControllerState | None:
        try:
            data = self.state_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return msgspec.json.decode(data, type=ControllerState)
        except msgspec.DecodeError as exc:
            raise ValueError(f"controller state {self.state_path} is corrupt: {exc}") from exc

    def save_state(self, state: ControllerState) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(msgspec.json.encode(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_path)
        dir_fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@dataclass
class RecordLog:
    """An `ActionSink` that appends each record as a JSON line to `path` (flushed, not fsync'd:
    it is a report; the journal is the truth). `vigil analyze` reads it beside the ranks' files."""

    path: Path

    def publish(self, record: Action | Finding | DiagResult) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            f.write(codec.encode_json(record) + b"\n")

    def replay(self) -> bool:
        return True


@dataclass
class Tee:
    """Gives every record to each sink in turn; one failing does not keep it from the others."""

    sinks: Sequence[ports.ActionSink]

    def publish(self, record: Action | Finding | DiagResult) -> None:
        for sink in self.sinks:
            try:
                sink.publish(record)
            except Exception as exc:  # best effort, as every sink
                log.warning("could not record %s in %s: %s", type(record).__name__, sink, exc)

    def replay(self) -> bool:
        return all([sink.replay() for sink in self.sinks])
