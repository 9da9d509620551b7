"""Triton kernels against their torch references, in Triton's interpreter (fp32/fp16) on CPU."""

from __future__ import annotations

import pytest
import torch

from vigil.kernels import (
    bandwidth,
    devices,
    gemm,
    triton_gemm,
    triton_gemm_tma,
    triton_hash,
    triton_stream,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"]
)
def test_matmul_matches_torch_on_ragged_shapes(dtype: torch.dtype, tolerance: float) -> None:
    gen = torch.Generator().manual_seed(0)
    # 70x96 @ 96x50: no dimension is a multiple of the 32-wide tiles, so edges are exercised.
    a = torch.randn(70, 96, generator=gen).to(dtype)
    b = torch.randn(96, 50, generator=gen).to(dtype)
    got = triton_gemm.matmul(a, b)
    want = a.float() @ b.float()
    assert got.dtype == dtype and got.shape == (70, 50)
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tolerance


def test_matmul_handles_strided_operands() -> None:
    a = torch.randn(40, 64)
    b = torch.randn(48, 64).t()  # column-major B, as cuBLAS and fp8 want it
    assert torch.allclose(triton_gemm.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)


def test_planted_fault_changes_exactly_one_element() -> None:
    a = torch.randint(-4, 5, (64, 48)).float()
    b = torch.randint(-4, 5, (48, 40)).float()
    got = triton_gemm.matmul(a, b, fault=triton_gemm.Fault(index=5 * 40 + 7))
    wrong = (got != a @ b).nonzero().tolist()
    assert wrong == [[5, 7]]


def test_matmul_rejects_bad_operands() -> None:
    with pytest.raises(ValueError, match="2-D operands"):
        triton_gemm.matmul(torch.ones(4, 3), torch.ones(4, 3))
    with pytest.raises(TypeError, match="share one of"):
        triton_gemm.matmul(torch.ones(4, 4), torch.ones(4, 4, dtype=torch.float16))


@pytest.mark.parametrize("op", bandwidth.STREAM_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_stream_kernels_match_torch(op: str, dtype: torch.dtype) -> None:
    n = 3000  # not a multiple of the block: the tail is masked
    x, y = torch.rand(n).to(dtype), torch.rand(n).to(dtype)
    got, want = torch.empty_like(x), torch.empty_like(x)
    triton_stream.run(op, got, x, y, bandwidth.SCALAR)
    bandwidth.torch_stream(op, want, x, y)
    assert torch.allclose(got.float(), want.float(), rtol=1e-3 if dtype == torch.float16 else 1e-6)


def test_stream_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one shape"):
        triton_stream.run("add", torch.empty(8), torch.ones(8), torch.ones(4), 1.0)


def test_integer_mixing_kernel_is_bit_exact_and_shows_a_fault() -> None:
    want = triton_hash.reference(5000, seed=0xDEADBEEF, rounds=32, device=CPU)
    assert torch.equal(triton_hash.run(5000, seed=0xDEADBEEF, rounds=32, device=CPU), want)
    faulty = triton_hash.run(
        5000, seed=0xDEADBEEF, rounds=32, device=CPU, fault_index=77, fault_mask=2
    )
    assert (faulty != want).nonzero().flatten().tolist() == [77]


@pytest.mark.parametrize("persistent", [False, True], ids=["tiled", "persistent"])
@pytest.mark.parametrize("column_major_b", [False, True], ids=["row-major-B", "column-major-B"])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"]
)
def test_tma_matmul_matches_torch(
    dtype: torch.dtype, tolerance: float, column_major_b: bool, persistent: bool
) -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(70, 96, generator=gen).to(dtype)  # 70 rows: TMA pads the ragged edge tile
    b = (
        torch.randn(64, 96, generator=gen).to(dtype).t()
        if column_major_b
        else torch.randn(96, 64, generator=gen).to(dtype)
    )
    got = triton_gemm_tma.matmul(a, b, persistent=persistent)
    want = a.float() @ b.float()
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tolerance


def test_gemm_diagnostic_reports_the_fastest_agreeing_triton_kernel() -> None:
    config = gemm.GemmConfig(size=64, dtypes=("fp32",), warmup=0, iters=1, interpret_on_cpu=True)
    (figures,) = gemm.run(devices.cpu_target(), config)
    assert figures.agrees and figures.rel_error is not None and figures.rel_error < 1e-5
    assert figures.triton_variant in ("pointer", "tma", "tma-persistent")
    assert figures.triton_tflops is not None and figures.ratio_to_torch is not None
    tests = [m.test for m in gemm.measurements([figures])]
    assert tests == ["gemm.fp32.torch", "gemm.fp32.triton", "gemm.fp32.disagreements"]
