"""The SDC diagnostic: exact checksums, a planted corruption caught, the odd device singled out."""

from __future__ import annotations

import torch

from vigil import schema
from vigil.kernels import devices, sdc, verdict

SMALL = {"size": 96, "rounds": 3, "hash_elements": 4096, "hash_rounds": 16}


def _judged(outcome: sdc.SdcOutcome) -> dict[str, schema.Verdict]:
    results = verdict.to_results(
        sdc.measurements(outcome),
        node="n1",
        device_id="cpu",
        sheet={},
        fleet=verdict.FleetBaseline(),
        time_s=0.0,
    )
    return {r.test: r.verdict for r in results}


def test_a_healthy_device_matches_the_exact_reference() -> None:
    outcome = sdc.run(devices.cpu_target(), sdc.SdcConfig(**SMALL))
    assert devices.backend_for(devices.cpu_target()) is devices.Backend.TRITON  # interpreter
    assert outcome.mismatches == 0 and outcome.checksum == outcome.expected
    assert _judged(outcome) == {"sdc.mismatches": "pass", "sdc.checksum": "pass"}


def test_a_planted_corruption_is_caught_and_fails_the_device() -> None:
    fault = sdc.Fault(round=1, index=500, mask=1 << 2)  # a low mantissa bit of one element
    outcome = sdc.run(devices.cpu_target(), sdc.SdcConfig(**SMALL, fault=fault))
    assert outcome.mismatched_rounds[0] == 1  # caught in the round it happened
    assert outcome.hash_mismatches == 1
    assert outcome.checksum != outcome.expected
    assert _judged(outcome) == {"sdc.mismatches": "fail", "sdc.checksum": "fail"}


def test_checksum_sees_single_bit_flips_and_swapped_values() -> None:
    values = torch.arange(-50, 50, dtype=torch.float32).reshape(10, 10)
    base = sdc.checksum(values)
    flipped = values.clone()
    flipped.view(-1).view(torch.int32)[13] ^= 1  # 1 ulp: the value rounds back to an integer
    swapped = values.clone().view(-1)
    swapped[[3, 4]] = swapped[[4, 3]]
    assert sdc.checksum(flipped) != base
    assert sdc.checksum(swapped.view(10, 10)) != base
    assert sdc.checksum(values.double()) == base  # fp64 references convert losslessly
    assert sdc.checksum(-0.0 * torch.ones(4)) == sdc.checksum(torch.zeros(4))


def test_the_device_that_disagrees_with_the_others_is_flagged() -> None:
    assert sdc.outliers({"GPU-a": 7, "GPU-b": 7, "GPU-c": 9, "GPU-d": 7}) == ["GPU-c"]
    assert sdc.outliers({"GPU-a": 7, "GPU-b": 9}) == ["GPU-a", "GPU-b"]  # no majority
    assert sdc.outliers({"GPU-a": 7}) == []


def test_operands_stay_in_the_exact_range() -> None:
    c = torch.tensor([-40.0, -5.0, 0.0, 4.0, 5.0, 1000.0])
    folded = sdc.next_operand(c)
    assert folded.min() >= -sdc.OPERAND_RANGE and folded.max() <= sdc.OPERAND_RANGE
