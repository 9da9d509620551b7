"""Which devices a diagnostic runs on and which kernel back end each one can use.

Discovers CUDA devices (name, UUID, compute capability) through torch and says whether Triton
kernels can run: compiled on a CUDA device, or interpreted on CPU when TRITON_INTERPRET=1.
Reads no NVML (see `vigil.kernels.thermal`) and starts no kernels.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass

import torch

CPU_DEVICE_ID = "cpu"


class Backend(enum.StrEnum):
    """How a diagnostic's kernels run on a device."""

    TRITON = "triton"  # Triton kernels, compiled for the GPU (or interpreted on CPU)
    TORCH = "torch"  # the torch reference implementation (cuBLAS, ATen) only


@dataclass(frozen=True, kw_only=True)
class Target:
    """One device a diagnostic runs on: `device_id` is the GPU UUID or "cpu"."""

    device: torch.device
    device_id: str
    name: str
    capability: tuple[int, int] = (0, 0)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def supports_bf16_dot(self) -> bool:
        return self.is_cuda and self.capability >= (8, 0)

    @property
    def supports_fp8_dot(self) -> bool:
        # fp8 tensor-core MMA exists from Ada (sm_89) and Hopper (sm_90) on.
        return self.is_cuda and self.capability >= (8, 9)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True when Triton kernels run in its NumPy interpreter (set before kernels are imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend_for(target: Target) -> Backend:
    """Triton on a CUDA device when Triton is installed, or anywhere under its interpreter."""
    if not triton_installed():
        return Backend.TORCH
    if target.is_cuda or triton_interpreted():
        return Backend.TRITON
    return Backend.TORCH


def cpu_target() -> Target:
    return Target(device=torch.device("cpu"), device_id=CPU_DEVICE_ID, name=_cpu_name())


def cuda_targets() -> list[Target]:
    """Every visible CUDA device, identified by its UUID so results follow the physical GPU."""
    if not torch.cuda.is_available():
        return []
    targets = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or f"cuda{index}")
        targets.append(
            Target(
                device=torch.device("cuda", index),
                device_id=uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",
                name=props.name,
                capability=(props.major, props.minor),
            )
        )
    return targets


def local_targets(*, cpu: bool = False) -> list[Target]:
    """The GPUs of this node, or the CPU when there are none (or when `cpu` is asked for)."""
    gpus = [] if cpu else cuda_targets()
    return gpus or [cpu_target()]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
