"""Collective bus bandwidth: nccl-tests' formulas by hand, then real gloo processes."""

from __future__ import annotations

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
    run = collectives.run_local(
        config, world_size=3, use_cuda=False, sdc_checksum=faulty_rank_checksum
    )
    assert {(f.op, f.per_rank_bytes) for f in run.figures} == {
        (op, size) for op in collectives.OPS for size in config.sizes
    }
    for f in run.figures:
        assert f.world_size == 3 and f.seconds > 0
        assert f.busbw_gb_s == pytest.approx(f.algbw_gb_s * collectives.bus_factor(f.op, 3))
        assert 1e-4 < f.busbw_gb_s < 1000  # loopback gloo: MB/s to tens of GB/s
    assert sdc.outliers({f"rank{r}": c for r, c in run.checksums.items()}) == ["rank1"]
    names = [m.test for m in collectives.measurements(run.figures)]
    assert "coll.all_reduce.1MiB.busbw" in names and "coll.reduce_scatter.64KiB.busbw" in names
