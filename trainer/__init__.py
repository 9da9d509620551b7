"""The bundled parallel GPT-style trainer that uses the SDK and recovers under the controller.

Public API: recipes (`Recipe`, `named`), the training loop (`Trainer`, `RunContext`, `ExitCode`),
checkpoint helpers a supervisor needs (`latest_committed`, `committed_steps`, `verify`), and
fault injection (`faults`: `fail_at`, `hang_at`, `slow`, `stall_at`, `nan_at`). Importing this
package does not import torch.distributed's heavier parts until they are used by a run.
"""

from vigil.trainer import faults
from vigil.trainer.checkpoint import committed_steps, latest_committed, verify
from vigil.trainer.faults import Fault, fail_at, hang_at, nan_at, slow, stall_at
from vigil.trainer.loop import ExitCode, RunContext, Trainer, TrainResult
from vigil.trainer.recipes import ModelConfig, ParallelConfig, Recipe, named

__all__ = [
    "ExitCode",
    "Fault",
    "ModelConfig",
    "ParallelConfig",
    "Recipe",
    "RunContext",
    "TrainResult",
    "Trainer",
    "committed_steps",
    "fail_at",
    "faults",
    "hang_at",
    "latest_committed",
    "named",
    "nan_at",
    "slow",
    "stall_at",
    "verify",
]
