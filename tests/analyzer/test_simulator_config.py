"""The simulator's determinism and measurement model; configuration validation."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import simulator as sim
from vigil import codec
from vigil.analyzer import arrays, config


def test_same_seed_same_streams_and_different_seed_differs() -> None:
    cfg = sim.ScenarioConfig(num_ranks=16, num_steps=20, seed=4)
    a, b = sim.simulate(cfg).arrays, sim.simulate(cfg).arrays
    assert np.array_equal(a.step_time_s, b.step_time_s)
    other = sim.simulate(sim.ScenarioConfig(num_ranks=16, num_steps=20, seed=5)).arrays
    assert not np.array_equal(a.step_time_s, other.step_time_s)


def test_records_round_trip_into_the_same_arrays() -> None:
    s = sim.simulate(sim.ScenarioConfig(num_ranks=8, num_steps=12, seed=1))
    lines = [codec.encode_json(r) for batch in s.records() for r in batch]
    rebuilt = arrays.from_records([codec.decode_json(line) for line in lines])
    assert rebuilt.job_id == "sim" and rebuilt.nodes[0] == "node0000"
    np.testing.assert_allclose(rebuilt.compute_s(), s.arrays.compute_s(), rtol=1e-5, atol=1e-6)
    # Transfer is attributed across ranks: the dp all-reduce's shortest member duration, the
    # same for every member (the simulator's per-rank split is not observable from records).
    shortest = np.maximum(s.arrays.comm_wait_s, s.arrays.transfer_s).min(axis=1)
    np.testing.assert_allclose(
        rebuilt.transfer_s, np.repeat(shortest[:, None], 8, axis=1), rtol=1e-5, atol=1e-6
    )


def test_synchronous_steps_end_together_and_the_slowest_waits_least() -> None:
    s = sim.simulate(sim.ScenarioConfig(num_ranks=16, num_steps=10, seed=2))
    a = s.arrays
    assert np.allclose(a.step_time_s, a.step_time_s[:, :1])
    arrival = a.data_s + a.compute_s()
    slowest = np.argmax(arrival, axis=1)
    assert np.array_equal(np.argmin(a.comm_wait_s, axis=1), slowest)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: config.StragglerConfig(min_hits=9, window=8), "min_hits must be in"),
        (lambda: config.StragglerConfig(small_group_z=4.5), "small_group_z must be in"),
        (lambda: config.StragglerConfig(strong_hits=13), "strong_hits must be in"),
        (lambda: config.StragglerConfig(strong_evidence=0.5), "strong_evidence must be >= 1"),
        (lambda: config.HangConfig(factor=0.5), "factor must be >= 1"),
        (lambda: config.MfuConfig(min_drop=1.5), "min_drop must be in"),
        (lambda: config.AnalyzerConfig(stream_window_steps=10), "stream_window_steps must be >="),
        (lambda: sim.ScenarioConfig(num_ranks=8, num_steps=5, pp=3), "pp must divide"),
        (
            lambda: sim.ScenarioConfig(
                num_ranks=8,
                num_steps=5,
                faults=(sim.Fault(kind=sim.FaultKind.STRAGGLER, ranks=(9,)),),
            ),
            "outside 0..7",
        ),
    ],
)
def test_bad_configuration_says_what_to_change(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
