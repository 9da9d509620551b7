"""Names of the diagnostics `vigil diag` runs, torch-free so the CLI can list them cheaply.

`vigil.kernels.suite.SuitePlan` has one field per name here (a test keeps them equal). Nothing
here imports torch, Triton or any other vigil.kernels module.
"""

from __future__ import annotations

DIAGNOSTICS = ("gemm", "bandwidth", "sdc", "memtest", "burn", "collectives")
