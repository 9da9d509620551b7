"""The bundled parallel GPT-style trainer that uses the SDK and recovers under the controller.

Public API: recipes (`Recipe`, `named`), the training loop (`Trainer`, `RunContext`,
`TrainResult`), exit codes (`ExitCode`), checkpoint helpers a supervisor needs
(`latest_committed`, `committed_steps`, `verify`) and fault injection (`fail_at`, `hang_at`,
`slow`, `stall_at`, `nan_at`, `Fault`). Names load on first use (PEP 562), so `import vigil`
and `import vigil.trainer` stay free of torch until a run needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ExitCode": "vigil.trainer.exits",
    "Fault": "vigil.trainer.faults",
    "ModelConfig": "vigil.trainer.recipes",
    "ParallelConfig": "vigil.trainer.recipes",
    "Recipe": "vigil.trainer.recipes",
    "RunContext": "vigil.trainer.loop",
    "TrainResult": "vigil.trainer.loop",
    "Trainer": "vigil.trainer.loop",
    "committed_steps": "vigil.trainer.checkpoint",
    "fail_at": "vigil.trainer.faults",
    "hang_at": "vigil.trainer.faults",
    "latest_committed": "vigil.trainer.checkpoint",
    "named": "vigil.trainer.recipes",
    "nan_at": "vigil.trainer.faults",
    "slow": "vigil.trainer.faults",
    "stall_at": "vigil.trainer.faults",
    "verify": "vigil.trainer.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vigil.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
