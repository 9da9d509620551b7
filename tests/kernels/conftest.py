"""Kernel tests run Triton kernels in its CPU interpreter when there is no GPU.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when vigil.kernels.triton_* is first
imported, so it is set here, before any test module imports them. With CUDA present the kernels
compile for the GPU instead and the `gpu` tests run.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
