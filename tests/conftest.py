"""Without a GPU, Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), and the
kernel tests run first.

Triton reads TRITON_INTERPRET when a function is decorated with `@triton.jit`, and its own
library functions (`tl.cdiv`, ...) are decorated when `triton` is first imported; the frameworks
the integration tests use (transformers, Lightning, Megatron-core) import triton through torch.
So the variable is set here, in the root conftest, which pytest loads before any test module.

The interpreter also relies on process-wide state of the `triton.language` module. In the full
suite, after the other subsystems' tests had run in the same process, every interpreted kernel
failed calling a compiled `tl.cdiv` ("Cannot call @triton.jit'd outside of the scope of a
kernel"), while the same kernel tests pass alone and after any one of the test folders
(agent through integrations) that run before them. Which earlier test leaves that state has not
been found; until it is, `tests/kernels/` runs before everything else (its tests are in-process
and share no state with the rest). With CUDA present the kernels compile for the GPU instead and
the `gpu` tests run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_KERNELS = Path(__file__).parent / "kernels"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if _KERNELS in item.path.parents else 1)  # stable: order kept
