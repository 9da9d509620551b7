"""Collective bus bandwidth against nccl-tests' published factors worked out by hand, then on real
gloo processes (nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for all_reduce and
x (n-1)/n for all_gather and reduce_scatter; algbw = size / time)."""

from __future__ import annotations

import time

import pytest

from vigil.kernels import collectives, devices, sdc


def test_all_reduce_busbw_matches_a_hand_computed_case() -> None:
    # 8 ranks all-reduce 1 GB in 10 ms: algbw 100 GB/s, busbw 100 x 2 x 7 / 8 = 175 GB/s.
    busbw = collectives.bus_bandwidth("all_reduce", size_bytes=10**9, seconds=0.01, world_size=8)
    assert busbw == pytest.approx(175e9)


def test_gather_and_scatter_busbw_match_hand_computed_cases() -> None:
    # 4 ranks, 256 MB per rank gathered: size 1.024 GB in 20 ms = 51.2 GB/s; x 3/4 = 38.4 GB/s.
    figure = collectives.CollectiveFigure(
        op="all_gather",
        size_bytes=collectives.size_counted("all_gather", 256 * 10**6, 4),
        world_size=4,
        seconds=0.02,
    )
    assert figure.size_bytes == 1_024_000_000
    assert figure.algbw_gb_s == pytest.approx(51.2)
    assert figure.busbw_gb_s == pytest.approx(38.4)
    # reduce_scatter over 2 ranks: factor 1/2.
    busbw = collectives.bus_bandwidth("reduce_scatter", size_bytes=8e9, seconds=1.0, world_size=2)
    assert busbw == pytest.approx(4e9)
    # One rank moves nothing over a bus.
    assert collectives.bus_factor("all_reduce", 1) == 0.0


# busbw / algbw, worked out by hand for concrete world sizes.
HAND_FACTORS = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5},
    3: {"all_reduce": 4 / 3, "all_gather": 2 / 3, "reduce_scatter": 2 / 3},
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875},
    16: {"all_reduce": 1.875, "all_gather": 0.9375, "reduce_scatter": 0.9375},
}


@pytest.mark.parametrize("world_size", sorted(HAND_FACTORS))
def test_bus_factors_are_nccl_tests_published_ones(world_size: int) -> None:
    factors = {op: collectives.bus_factor(op, world_size) for op in collectives.OPS}
    assert factors == pytest.approx(HAND_FACTORS[world_size])


def test_busbw_of_concrete_sizes_worked_out_by_hand() -> None:
    # 16 ranks all-gather 64 MiB each in 50 ms: size 16 x 64 MiB = 1,073,741,824 B,
    # algbw 21.47483648 GB/s, busbw x 15/16 = 20.1326592 GB/s.
    size = collectives.size_counted("all_gather", 64 << 20, 16)
    assert size == 1_073_741_824
    figure = collectives.CollectiveFigure(
        op="all_gather", size_bytes=size, world_size=16, seconds=0.05
    )
    assert figure.algbw_gb_s == pytest.approx(21.47483648)
    assert figure.busbw_gb_s == pytest.approx(20.1326592)
    assert figure.per_rank_bytes == 64 << 20
    # 2 ranks all-reduce 256 MiB in 0.1 s: factor 1, busbw = algbw = 2.68435456 GB/s.
    busbw = collectives.bus_bandwidth("all_reduce", size_bytes=256 << 20, seconds=0.1, world_size=2)
    assert busbw == pytest.approx(2.68435456e9)
    # A buffer that is not whole fp32 elements is counted as the elements moved: 1,001 B -> 1,000.
    assert collectives.size_counted("all_reduce", 1001, 4) == 1000
    assert collectives.size_counted("reduce_scatter", 1001, 4) == 4000


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="collective op"):
        collectives.bus_factor("broadcast", 4)
    with pytest.raises(ValueError, match="seconds > 0"):
        collectives.bus_bandwidth("all_reduce", size_bytes=1, seconds=0.0, world_size=2)
    with pytest.raises(ValueError, match=">= 2 processes"):
        collectives.run_local(collectives.CollectiveConfig(), world_size=1, use_cuda=False)


def faulty_rank_checksum(rank: int) -> int:
    """Each worker runs the SDC GEMM chain on its CPU; rank 1 has a planted corruption."""
    fault = sdc.Fault(round=0, index=3) if rank == 1 else None
    config = sdc.SdcConfig(size=48, rounds=2, hash_elements=16, hash_rounds=1, fault=fault)
    return sdc.run(devices.cpu_target(), config).checksum


@pytest.mark.e2e
def test_gloo_processes_measure_busbw_and_single_out_the_corrupt_rank() -> None:
    config = collectives.CollectiveConfig(
        sizes=(64 << 10, 1 << 20), warmup=1, iters=3, timeout_s=120.0
    )
    started = time.perf_counter()
    run = collectives.run_local(
        config, world_size=3, use_cuda=False, sdc_checksum=faulty_rank_checksum
    )
    wall_s = time.perf_counter() - started
    # Sizes as nccl-tests counts them over 3 ranks: the buffer (all_reduce), else 3 buffers.
    counted = {
        ("all_reduce", 64 << 10): 65_536,
        ("all_reduce", 1 << 20): 1_048_576,
        ("all_gather", 64 << 10): 196_608,
        ("all_gather", 1 << 20): 3_145_728,
        ("reduce_scatter", 64 << 10): 196_608,
        ("reduce_scatter", 1 << 20): 3_145_728,
    }
    assert {(f.op, f.per_rank_bytes): f.size_bytes for f in run.figures} == counted
    for f in run.figures:
        assert f.world_size == 3 and f.seconds > 0
        assert f.algbw_gb_s == pytest.approx(f.size_bytes / f.seconds / 1e9)
        assert f.busbw_gb_s == pytest.approx(f.algbw_gb_s * HAND_FACTORS[3][f.op])
        assert 1e-4 < f.busbw_gb_s < 1000  # loopback gloo: MB/s to tens of GB/s
    # The times are seconds per collective: every timed call (warmup too) fits in the run.
    calls = config.warmup + config.iters
    assert sum(calls * f.seconds for f in run.figures) < wall_s
    assert sdc.outliers({f"rank{r}": c for r, c in run.checksums.items()}) == ["rank1"]
    names = [m.test for m in collectives.measurements(run.figures)]
    assert "coll.all_reduce.1MiB.busbw" in names and "coll.reduce_scatter.64KiB.busbw" in names
