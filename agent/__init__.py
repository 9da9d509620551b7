"""SDK hooks inside training processes and the per-node agent daemon.

Training code uses `init`, `watch`, `step`, `span`, `on_control` and `shutdown` (see
`vigil.agent.sdk`). vigil.agent must not import vigil.collector (import-linter contract).
"""

from vigil.agent.config import AgentConfig, SdkConfig, ShipperConfig
from vigil.agent.sdk import current, init, on_control, shutdown, span, step, watch
from vigil.agent.session import Session, StepHandle

__all__ = [
    "AgentConfig",
    "SdkConfig",
    "Session",
    "ShipperConfig",
    "StepHandle",
    "current",
    "init",
    "on_control",
    "shutdown",
    "span",
    "step",
    "watch",
]
