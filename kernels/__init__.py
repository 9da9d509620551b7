"""Diagnostic kernels (Triton, CUDA C++) with torch reference implementations and CPU fallbacks.

`vigil diag` (vigil.kernels.cli) runs them as a suite (vigil.kernels.suite) and judges the
results against the fleet baseline and the device's spec sheet (vigil.kernels.verdict).
Importing this package imports neither torch nor Triton: the names below load their modules on
first use (PEP 562), and the Triton modules (triton_*) load only where Triton can run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vigil.kernels.bandwidth import BandwidthConfig
    from vigil.kernels.collectives import CollectiveConfig, bus_bandwidth, bus_factor
    from vigil.kernels.devices import Backend, Target, cpu_target, cuda_targets, local_targets
    from vigil.kernels.gemm import GemmConfig
    from vigil.kernels.measurement import Kind, Measurement
    from vigil.kernels.memtest import MemFault, MemtestConfig
    from vigil.kernels.sdc import Fault as SdcFault
    from vigil.kernels.sdc import SdcConfig
    from vigil.kernels.ship import Delivery, ShipConfig, send
    from vigil.kernels.suite import Level, Suite, SuitePlan, default_plan, healthy, run_node
    from vigil.kernels.thermal import BurnConfig
    from vigil.kernels.verdict import FleetBaseline, judge

_EXPORTS = {
    "BandwidthConfig": ("bandwidth", "BandwidthConfig"),
    "CollectiveConfig": ("collectives", "CollectiveConfig"),
    "bus_bandwidth": ("collectives", "bus_bandwidth"),
    "bus_factor": ("collectives", "bus_factor"),
    "Backend": ("devices", "Backend"),
    "Target": ("devices", "Target"),
    "cpu_target": ("devices", "cpu_target"),
    "cuda_targets": ("devices", "cuda_targets"),
    "local_targets": ("devices", "local_targets"),
    "GemmConfig": ("gemm", "GemmConfig"),
    "Kind": ("measurement", "Kind"),
    "Measurement": ("measurement", "Measurement"),
    "MemFault": ("memtest", "MemFault"),
    "MemtestConfig": ("memtest", "MemtestConfig"),
    "SdcFault": ("sdc", "Fault"),
    "SdcConfig": ("sdc", "SdcConfig"),
    "Delivery": ("ship", "Delivery"),
    "ShipConfig": ("ship", "ShipConfig"),
    "send": ("ship", "send"),
    "Level": ("suite", "Level"),
    "Suite": ("suite", "Suite"),
    "SuitePlan": ("suite", "SuitePlan"),
    "default_plan": ("suite", "default_plan"),
    "healthy": ("suite", "healthy"),
    "run_node": ("suite", "run_node"),
    "BurnConfig": ("thermal", "BurnConfig"),
    "FleetBaseline": ("verdict", "FleetBaseline"),
    "judge": ("verdict", "judge"),
}

__all__ = [
    "Backend",
    "BandwidthConfig",
    "BurnConfig",
    "CollectiveConfig",
    "Delivery",
    "FleetBaseline",
    "GemmConfig",
    "Kind",
    "Level",
    "Measurement",
    "MemFault",
    "MemtestConfig",
    "SdcConfig",
    "SdcFault",
    "ShipConfig",
    "Suite",
    "SuitePlan",
    "Target",
    "bus_bandwidth",
    "bus_factor",
    "cpu_target",
    "cuda_targets",
    "default_plan",
    "healthy",
    "judge",
    "local_targets",
    "run_node",
    "send",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vigil.kernels' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(f"vigil.kernels.{module}"), attr)
    globals()[name] = value
    return value
