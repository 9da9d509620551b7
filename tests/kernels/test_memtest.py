"""The memory test: the CUDA source builds with nvcc; every pass family catches a stuck bit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vigil.kernels import devices, memtest, memtest_engines


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))
    return str(candidates[-1]) if candidates else None


@pytest.mark.integration
@pytest.mark.skipif(_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
def test_cuda_source_compiles_for_hopper(tmp_path: Path) -> None:
    nvcc = _nvcc()
    assert nvcc is not None
    done = subprocess.run(
        [
            nvcc,
            "-arch=sm_90",
            "-O3",
            "-Werror",
            "all-warnings",
            "-c",
            str(memtest_engines.CSRC / "memtest.cu"),
            "-o",
            str(tmp_path / "memtest.o"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    symbols = subprocess.run(
        ["nm", "-C", str(tmp_path / "memtest.o")], capture_output=True, text=True, timeout=30
    ).stdout
    for launcher in ("vigil_memtest_fill", "vigil_memtest_verify", "vigil_memtest_verify_write"):
        assert launcher in symbols


def _config(**kwargs: object) -> memtest.MemtestConfig:
    base: dict[str, object] = {"cpu_bytes": 1 << 20, "chunk_bytes": 1 << 20}
    base.update(kwargs)
    return memtest.MemtestConfig(**base)  # type: ignore[arg-type]


def test_healthy_memory_passes_every_pattern() -> None:
    outcome = memtest.run(
        devices.cpu_target(),
        _config(cpu_bytes=3 << 20, patterns=memtest.FULL_PATTERNS, walking_bits=(0, 31)),
    )
    assert outcome.failing_words == 0 and outcome.first_failing_word is None
    assert outcome.tested_bytes == 3 << 20
    # 2 address sweeps x (fill + verify), 4 patterns x (fill + 2 verify-writes + verify), 2 bits
    assert outcome.bytes_moved == (2 * 8 + 4 * (4 + 16 + 4) + 2 * 8) * (3 << 20) // 4
    assert 0 < outcome.coverage < 1 and outcome.tb_per_s > 0


@pytest.mark.parametrize(
    ("passes", "expected_failures"),
    [
        ({"address": True, "patterns": (), "walking_bits": ()}, 2),
        ({"address": False, "patterns": (0,), "walking_bits": ()}, 3),
        ({"address": False, "patterns": (), "walking_bits": (7,)}, 1),  # the stuck bit's own
        ({"address": False, "patterns": (), "walking_bits": (3,)}, 1),
    ],
    ids=["address-in-address", "moving-inversions", "walking-ones-same-bit", "walking-ones"],
)
def test_each_pass_family_catches_a_stuck_bit(
    passes: dict[str, object], expected_failures: int
) -> None:
    # Word 300_000 sits in the second 1 MiB chunk: indices are reported over all of memory.
    fault = memtest.MemFault(index=300_000, mask=1 << 7)
    outcome = memtest.run(devices.cpu_target(), _config(cpu_bytes=2 << 20, fault=fault, **passes))
    assert outcome.failing_words == expected_failures
    assert outcome.first_failing_word == 300_000
    results = memtest.measurements(outcome)
    assert results[0].test == "memtest.failing_words" and results[0].value == expected_failures


def test_allocation_splits_into_chunks_and_bad_settings_are_refused() -> None:
    chunks = memtest.allocate(devices.cpu_target().device, (5 << 20) + 64, _config())
    assert [c.numel() * 4 for c in chunks] == [1 << 20] * 5 + [64]
    with pytest.raises(ValueError, match="past the"):
        memtest.run(devices.cpu_target(), _config(fault=memtest.MemFault(index=1 << 30)))
    with pytest.raises(ValueError, match="fraction_of_free"):
        memtest.MemtestConfig(fraction_of_free=1.0)
