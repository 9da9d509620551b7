"""Verdicts: SuperBench's 5 % fleet rule, spec-sheet floors, exact checksums, baseline files."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil import codec, schema
from vigil.kernels import measurement, spec, verdict

Kind = measurement.Kind


def _perf(value: float, *, higher_is_better: bool = True) -> measurement.Measurement:
    return measurement.Measurement(
        test="gemm.bf16.triton", value=value, unit="TFLOP/s", higher_is_better=higher_is_better
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [(100.0, "pass"), (95.0, "pass"), (94.9, "suspect"), (120.0, "pass")],
)
def test_more_than_five_percent_below_the_fleet_median_is_suspect(
    value: float, expected: str
) -> None:
    assert verdict.judge(_perf(value), baseline=100.0, figure=None) == expected


def test_lower_is_better_figures_are_judged_the_other_way() -> None:
    hot = _perf(84.0, higher_is_better=False)
    assert verdict.judge(hot, baseline=80.0, figure=None) == "pass"
    assert (
        verdict.judge(_perf(84.1, higher_is_better=False), baseline=80.0, figure=None) == "suspect"
    )


def test_spec_sheet_floor_makes_a_device_suspect_even_when_the_fleet_is_slow() -> None:
    h200 = spec.spec_sheet("NVIDIA H200")
    assert h200["gemm.bf16"].peak == pytest.approx(989.4)
    figure = h200["gemm.bf16"]
    assert verdict.judge(_perf(790.0), baseline=None, figure=figure) == "pass"
    # The whole fleet is slow (baseline 500) but the spec floor (60 % of 989) still applies.
    assert verdict.judge(_perf(500.0), baseline=500.0, figure=figure) == "suspect"
    assert verdict.judge(_perf(790.0), baseline=None, figure=None) == "unknown"
    assert spec.spec_sheet("NVIDIA H100 80GB HBM3")["hbm"].peak == pytest.approx(3350.0)
    assert spec.spec_sheet("Intel Xeon") == {}


def test_errors_and_checksums_fail_on_any_difference() -> None:
    errors = measurement.Measurement(
        test="memtest.failing_words", value=1, unit="count", kind=Kind.ERRORS
    )
    assert verdict.judge(errors, baseline=None, figure=None) == "fail"
    clean = measurement.Measurement(
        test="memtest.failing_words", value=0, unit="count", kind=Kind.ERRORS
    )
    assert verdict.judge(clean, baseline=5.0, figure=None) == "pass"
    ok = measurement.Measurement(
        test="sdc.checksum", value=42, unit="", kind=Kind.CHECKSUM, expected=42
    )
    assert verdict.judge(ok, baseline=42.0, figure=None) == "pass"
    # Matches its own reference but not the fleet: the reference path itself is wrong here.
    assert verdict.judge(ok, baseline=43.0, figure=None) == "fail"
    bad = measurement.Measurement(
        test="sdc.checksum", value=41, unit="", kind=Kind.CHECKSUM, expected=42
    )
    assert verdict.judge(bad, baseline=None, figure=None) == "fail"


def _result(node: str, test: str, value: float) -> schema.DiagResult:
    return schema.DiagResult(node=node, device="GPU-x", test=test, value=value)


def test_fleet_baseline_is_the_median_and_the_most_common_checksum(tmp_path: Path) -> None:
    records = [_result(f"n{i}", "stream.copy.triton", v) for i, v in enumerate([4300, 4250, 2000])]
    records += [_result(f"n{i}", "sdc.checksum", v) for i, v in enumerate([7, 7, 9])]
    lines = tmp_path / "fleet.jsonl"
    lines.write_text("".join(codec.encode_json(r).decode() + "\n" for r in records))
    fleet = verdict.FleetBaseline.load(lines)
    assert fleet.get("stream.copy.triton") == 4250 and fleet.get("sdc.checksum") == 7
    plain = tmp_path / "fleet.json"
    plain.write_text('{"gemm.bf16.triton": 712.5}')
    assert verdict.FleetBaseline.load(plain).get("gemm.bf16.triton") == 712.5
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"type": "diag", "node": "n1"}\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:1"):
        verdict.FleetBaseline.load(broken)


def test_results_carry_baseline_spec_and_verdict() -> None:
    found = [
        _perf(500.0),
        measurement.Measurement(
            test="memtest.coverage", value=0.93, unit="fraction", kind=Kind.INFO
        ),
    ]
    results = verdict.to_results(
        found,
        node="node-7",
        device_id="GPU-1234",
        sheet=spec.spec_sheet("NVIDIA H200"),
        fleet=verdict.FleetBaseline(values={"gemm.bf16.triton": 700.0}),
        time_s=1.7e9,
    )
    gemm, coverage = results
    assert (gemm.node, gemm.device, gemm.baseline, gemm.verdict) == (
        "node-7",
        "GPU-1234",
        700.0,
        "suspect",
    )
    assert gemm.spec is None  # no spec_key on this measurement
    assert coverage.verdict == "unknown"
