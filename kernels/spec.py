"""Spec-sheet figures of the GPUs vigil knows, and how close to them a healthy device gets.

Peak numbers are the vendors' published dense figures (no sparsity). A healthy device reaches
only part of a peak (cuBLAS bf16 GEMM ~80 %, HBM copy ~90 %, PCIe ~85 %), so each figure comes
with the floor below which vigil calls a device suspect. Pure data; no device queries here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SpecFigure:
    peak: float
    unit: str
    # A healthy device measures at least peak * floor; below is suspect.
    floor: float

    def __post_init__(self) -> None:
        if self.peak <= 0 or not 0 < self.floor <= 1:
            raise ValueError(f"spec figure needs peak > 0 and 0 < floor <= 1, got {self}")

    @property
    def minimum(self) -> float:
        return self.peak * self.floor


# Floors: measured healthy Hoppers sit well above them (H200: cuBLAS bf16 ~790 of 989 TFLOP/s,
# D2D copy ~4.3 of 4.8 TB/s, pinned H2D ~55 of 64 GB/s on PCIe Gen5 x16).
_GEMM_FLOOR = 0.6
_HBM_FLOOR = 0.7
_PCIE_FLOOR = 0.6


def _hopper(*, bf16: float, fp8: float, hbm_tb_s: float, pcie_gb_s: float) -> dict[str, SpecFigure]:
    return {
        "gemm.bf16": SpecFigure(peak=bf16, unit="TFLOP/s", floor=_GEMM_FLOOR),
        "gemm.fp16": SpecFigure(peak=bf16, unit="TFLOP/s", floor=_GEMM_FLOOR),
        "gemm.fp8": SpecFigure(peak=fp8, unit="TFLOP/s", floor=_GEMM_FLOOR),
        "hbm": SpecFigure(peak=hbm_tb_s * 1000, unit="GB/s", floor=_HBM_FLOOR),
        "pcie": SpecFigure(peak=pcie_gb_s, unit="GB/s", floor=_PCIE_FLOOR),
    }


# Matched against torch's device name by substring, most specific first.
SPEC_SHEETS: tuple[tuple[str, dict[str, SpecFigure]], ...] = (
    ("H200", _hopper(bf16=989.4, fp8=1978.9, hbm_tb_s=4.8, pcie_gb_s=64.0)),
    ("H100 NVL", _hopper(bf16=835.0, fp8=1670.0, hbm_tb_s=3.9, pcie_gb_s=64.0)),
    ("H100 PCIe", _hopper(bf16=756.0, fp8=1513.0, hbm_tb_s=2.0, pcie_gb_s=64.0)),
    ("H100", _hopper(bf16=989.4, fp8=1978.9, hbm_tb_s=3.35, pcie_gb_s=64.0)),
    (
        "A100",
        {
            "gemm.bf16": SpecFigure(peak=312.0, unit="TFLOP/s", floor=_GEMM_FLOOR),
            "gemm.fp16": SpecFigure(peak=312.0, unit="TFLOP/s", floor=_GEMM_FLOOR),
            "hbm": SpecFigure(peak=1555.0, unit="GB/s", floor=_HBM_FLOOR),
            "pcie": SpecFigure(peak=32.0, unit="GB/s", floor=_PCIE_FLOOR),
        },
    ),
)


def spec_sheet(device_name: str) -> dict[str, SpecFigure]:
    """The spec figures of a device by its name ("NVIDIA H200"), or {} when vigil has none."""
    for pattern, sheet in SPEC_SHEETS:
        if pattern in device_name:
            return sheet
    return {}
