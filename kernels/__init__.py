"""Diagnostic kernels (Triton, CUDA C++) with torch reference implementations and CPU fallbacks.

`vigil diag` (vigil.kernels.cli) runs them as a suite (vigil.kernels.suite) and judges the
results against the fleet baseline and the device's spec sheet (vigil.kernels.verdict). Modules
that import Triton (triton_gemm, triton_gemm_tma, triton_stream, triton_hash) are loaded lazily,
only where Triton can run, so importing this package never needs Triton or a GPU.
"""

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
