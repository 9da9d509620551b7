"""GPU-only checks (marker `gpu`): compiled Triton kernels, bf16/fp8, the CUDA memory test, NVML.

Skipped cleanly without CUDA. bench/gpu/run.sh runs these on an H200 and counts passes/failures.
"""

from __future__ import annotations

import pytest
import torch

from vigil.kernels import (
    devices,
    gemm,
    memtest,
    sdc,
    suite,
    thermal,
    triton_gemm,
    triton_gemm_tma,
    triton_stream,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# Fixed tiles: correctness needs one compile per kernel, not an autotuning sweep.
META = triton_gemm.FIXED_META
FP8_META = {**triton_gemm.FIXED_META, "BLOCK_K": 128}


@pytest.fixture
def target() -> devices.Target:
    return devices.cuda_targets()[0]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_triton_gemm_agrees_with_cublas(target: devices.Target, dtype: str) -> None:
    a, b = gemm.operands(2048, gemm.DTYPE_NAMES[dtype], target.device)
    err = gemm.relative_error(triton_gemm.matmul(a, b, meta=META), gemm.torch_matmul(a, b))
    assert err <= gemm.AGREEMENT_TOLERANCE[gemm.DTYPE_NAMES[dtype]]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_triton_tma_gemm_agrees_with_cublas(target: devices.Target, dtype: str) -> None:
    if target.capability < (9, 0):
        pytest.skip("TMA needs sm_90+")
    a, b = gemm.operands(2048, gemm.DTYPE_NAMES[dtype], target.device)
    want = gemm.torch_matmul(a, b)
    for persistent in (False, True):
        got = triton_gemm_tma.matmul(a, b, meta=META, persistent=persistent)
        assert gemm.relative_error(got, want) <= gemm.AGREEMENT_TOLERANCE[gemm.DTYPE_NAMES[dtype]]


def test_triton_fp8_gemms_agree_with_scaled_mm(target: devices.Target) -> None:
    if not target.supports_fp8_dot:
        pytest.skip(f"{target.name} has no fp8 tensor cores")
    a, b = gemm.operands(2048, torch.float8_e4m3fn, target.device)
    want = gemm.torch_matmul(a, b)
    assert gemm.relative_error(triton_gemm.matmul(a, b, meta=FP8_META), want) <= 3e-2
    if target.capability >= (9, 0):
        assert gemm.relative_error(triton_gemm_tma.matmul(a, b, meta=FP8_META), want) <= 3e-2


def test_gemm_diagnostic_reports_both_implementations(target: devices.Target) -> None:
    (figures,) = gemm.run(target, gemm.GemmConfig(size=8192, dtypes=("bf16",), iters=5))
    assert figures.agrees and figures.triton_tflops is not None
    assert 10 < figures.torch_tflops < 5000 and 10 < figures.triton_tflops < 5000


@pytest.mark.parametrize("op", ["copy", "scale", "add", "triad"])
def test_stream_kernels_are_exact_on_gpu(target: devices.Target, op: str) -> None:
    x = torch.rand(1 << 22, device=target.device)
    y = torch.rand(1 << 22, device=target.device)
    got, want = torch.empty_like(x), torch.empty_like(x)
    triton_stream.run(op, got, x, y, 3.0)
    from vigil.kernels import bandwidth

    bandwidth.torch_stream(op, want, x, y)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


def test_sdc_on_gpu_matches_reference_and_catches_a_fault(target: devices.Target) -> None:
    clean = sdc.run(target, sdc.SdcConfig(size=1024, rounds=3, hash_elements=1 << 20))
    assert clean.mismatches == 0 and clean.checksum == clean.expected
    fault = sdc.Fault(round=1, index=12345)
    bad = sdc.run(target, sdc.SdcConfig(size=1024, rounds=3, hash_elements=1 << 20, fault=fault))
    assert bad.mismatched_rounds[0] == 1 and bad.hash_mismatches == 1


def test_cuda_memtest_builds_runs_and_catches_a_stuck_bit(target: devices.Target) -> None:
    # Built where torch keeps extensions (TORCH_EXTENSIONS_DIR), so later runs reuse the build.
    config = memtest.MemtestConfig(fraction_of_free=0.05, chunk_bytes=256 << 20)
    clean = memtest.run(target, config)
    assert clean.failing_words == 0 and clean.coverage > 0.04
    fault = memtest.MemFault(index=(256 << 20) // 4 + 99, mask=1 << 5)  # in the second chunk
    faulty = memtest.run(
        target,
        memtest.MemtestConfig(fraction_of_free=0.05, chunk_bytes=256 << 20, fault=fault),
    )
    # address x2 + moving inversions x3 + 4 walking bits (bit 5 is not among them, still caught)
    assert faulty.failing_words == 2 + 3 + 4
    assert faulty.first_failing_word == fault.index


def test_nvml_reads_the_device_under_test(target: devices.Target) -> None:
    sampler = thermal.sampler_for(target)
    sample = sampler.sample()
    assert isinstance(sampler, thermal.NvmlSampler)
    assert sample.sm_mhz is not None and sample.sm_mhz > 0
    assert sample.temperature_c is not None and 10 < sample.temperature_c < 110


def test_quick_suite_passes_on_a_healthy_gpu() -> None:
    targets = devices.cuda_targets()
    plan = suite.default_plan(suite.Level.QUICK, on_gpu=True)
    results = suite.Suite(plan=plan, targets=targets).run()
    bad = [r for r in results if r.verdict in ("fail", "suspect")]
    assert not bad, bad
