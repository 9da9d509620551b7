"""SDK hooks inside training processes and the per-node agent daemon.

Training code uses `init`, `watch`, `step`, `span`, `on_control`, `label_group`,
`checkpoint_committed` and `shutdown` (see `vigil.agent.sdk`), and `snapshots` for per-step
in-memory snapshots (`vigil.recovery.snapshots`, re-exported here). Importing `vigil.agent`
imports neither torch nor starts anything: the SDK functions load on first use (PEP 562), so
`vigil agent` runs on nodes without torch.
vigil.agent must not import vigil.collector (import-linter contract).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vigil.agent.config import AgentConfig, SdkConfig, ShipperConfig

if TYPE_CHECKING:
    from vigil.agent.sdk import (
        checkpoint_committed,
        current,
        init,
        label_group,
        on_control,
        shutdown,
        span,
        step,
        watch,
    )
    from vigil.agent.session import Session, StepHandle
    from vigil.recovery.snapshots import Snapshots, snapshots

_LAZY = {
    "checkpoint_committed": "sdk",
    "current": "sdk",
    "init": "sdk",
    "label_group": "sdk",
    "on_control": "sdk",
    "shutdown": "sdk",
    "span": "sdk",
    "step": "sdk",
    "watch": "sdk",
    "Session": "session",
    "StepHandle": "session",
    "Snapshots": "vigil.recovery.snapshots",
    "snapshots": "vigil.recovery.snapshots",
}

__all__ = [
    "AgentConfig",
    "SdkConfig",
    "Session",
    "ShipperConfig",
    "Snapshots",
    "StepHandle",
    "checkpoint_committed",
    "current",
    "init",
    "label_group",
    "on_control",
    "shutdown",
    "snapshots",
    "span",
    "step",
    "watch",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vigil.agent' has no attribute {name!r}")
    path = module if "." in module else f"vigil.agent.{module}"
    value = getattr(importlib.import_module(path), name)
    globals()[name] = value  # later lookups skip this hook (it runs once per name)
    return value
