"""Analysing a recorded real job prints nothing but its report: numpy's warnings (a step no
rank timed reads as an all-NaN slice) would reach the user's stderr from `vigil analyze`.

data/jsonl_untimed_steps/fsdp-slow1.1-forward: a `bench/faults.py` FSDP2 job whose rank 2 is
slowed 1.1x before forward from step 8; its straggler finding's baseline took the median over
steps some of which no rank timed, and warned."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.analyzer import recorded
from vigil.analyzer import offline

JOBS = sorted(
    {p.parent for p in recorded.DATA.glob("jsonl_*/**/rank-*.jsonl")}, key=lambda p: str(p)
)


@pytest.mark.parametrize("job", JOBS, ids=lambda p: str(p.relative_to(recorded.DATA)))
def test_a_recorded_job_is_analysed_without_warnings(job: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = offline.analyze_path(str(job))
    assert report.num_records > 0  # (some recordings hold a corrupt line on purpose)


def test_the_untimed_steps_job_names_its_straggler() -> None:
    job = recorded.DATA / "jsonl_untimed_steps" / "fsdp-slow1.1-forward"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = offline.analyze_path(str(job)).findings
    assert [(f.kind, f.subjects.ranks) for f in found] == [("straggler", [2])], found
