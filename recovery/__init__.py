"""The recovery controller: pure policy, checkpoint management and executors.

`Controller` runs the loop: rank exits and findings (`CollectorFindings`) go through the pure
`decide` (`policy`), and the planned actions are journaled (`Journal`) before an `Executor` carries
them out (`LocalExecutor` today, Kubernetes later) over a `Placement` of ranks on nodes.
`Snapshotter` keeps per-step in-memory snapshots inside the ranks. Importing this package imports
none of its modules: the names below load theirs on first use (PEP 562), so the trainer's
`from vigil.recovery import snapshot` and the pure `policy` never pay for the controller's
executors (psutil, the agent's stack dumps) or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vigil.recovery.checkpoint_request import PageCheckpointer
    from vigil.recovery.collector_link import CollectorActions, CollectorFindings
    from vigil.recovery.controller import (
        ActionSink,
        Checkpointer,
        Controller,
        ControllerConfig,
        FindingSource,
    )
    from vigil.recovery.executor import Executor, RankExit
    from vigil.recovery.journal import ControllerState, Journal
    from vigil.recovery.local import LocalExecutor
    from vigil.recovery.placement import Placement
    from vigil.recovery.policy import Budget, Context, Decision, Severity, Step, decide, severity
    from vigil.recovery.snapshot import Snapshotter

_EXPORTS = {
    "PageCheckpointer": "checkpoint_request",
    "CollectorActions": "collector_link",
    "CollectorFindings": "collector_link",
    "ActionSink": "controller",
    "Checkpointer": "controller",
    "Controller": "controller",
    "ControllerConfig": "controller",
    "FindingSource": "controller",
    "Executor": "executor",
    "RankExit": "executor",
    "ControllerState": "journal",
    "Journal": "journal",
    "LocalExecutor": "local",
    "Placement": "placement",
    "Budget": "policy",
    "Context": "policy",
    "Decision": "policy",
    "Severity": "policy",
    "Step": "policy",
    "decide": "policy",
    "severity": "policy",
    "Snapshotter": "snapshot",
}

__all__ = [
    "ActionSink",
    "Budget",
    "Checkpointer",
    "CollectorActions",
    "CollectorFindings",
    "Context",
    "Controller",
    "ControllerConfig",
    "ControllerState",
    "Decision",
    "Executor",
    "FindingSource",
    "Journal",
    "LocalExecutor",
    "PageCheckpointer",
    "Placement",
    "RankExit",
    "Severity",
    "Snapshotter",
    "Step",
    "decide",
    "severity",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vigil.recovery' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"vigil.recovery.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
