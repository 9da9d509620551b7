"""`vigil controller --kubernetes` killed at each stage of a recovery and started again acts once:
one quarantine, one eviction, one JobSet restart, no pod back on the bad node."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recovery.k8s.killed import STAGES, killed_run


@pytest.mark.e2e
@pytest.mark.parametrize("stage", STAGES)
def test_killed_controller_acts_exactly_once(stage: str, tmp_path: Path) -> None:
    outcome = killed_run(stage, "training", tmp_path)
    assert outcome.first_exit == 70, "the first controller did not reach the stage"
    assert outcome.second_exit == 0
    assert (outcome.restarts, outcome.evictions, outcome.quarantines) == (1, 1, 1)
    assert outcome.pods_on_bad_node == 0
