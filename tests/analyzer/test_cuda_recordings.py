"""Real jobs recorded on a GPU: the slow rank is named from what the SDK ships on CUDA.

The fixtures in data/jsonl_cuda/ are the SDK's own JSONL of `tests/realjobs/train.py
--device cuda` on one H200 (bench/gpu/run.sh, stage cuda_jobs): 4 ranks share the GPU over
gloo, their collectives timed with CUDA events. From step 8 one rank is slow on its device (a
kernel spins on its stream), so its host never waits for anything of its own:

- plain-forward-1.25x/: a loop calling dist.all_reduce; rank 1 spins a quarter of a step
  before each forward. The host returns from a synchronous all-reduce only once its own queued
  kernels have run too, so the host's time there is the same on every rank; each op's device
  time (the step record's `comm_wait_s` on CUDA) is not: rank 1 waits least.
- plain_async-forward-2x/: the same loop launching every all-reduce asynchronously, then
  waiting for each (`Work.wait`); rank 1 spins a whole step before each forward. A waited op
  exposes its device time from the waiting stream's event at the wait to the op's end.
- plain-optimizer-2x/, ddp-optimizer-2x/: rank 3 spins a whole step after its optimizer step.
  Its next batch's copy from pageable memory (inside `span("data")`) waits for that spin on
  the host; the span's device-idle time (`data_s` on CUDA) leaves it out, so the rank is a
  straggler and not a data stall.
- plain-clean/, ddp-clean/: no fault; every rank sleeps 0-30 % of a step on the host before
  each forward.
"""

from __future__ import annotations

import pytest

from tests.analyzer import recorded
from tests.analyzer.recorded import analyse, named
from vigil import schema

DATA = recorded.DATA / "jsonl_cuda"
CASES = [
    ("plain-forward-1.25x", [("straggler", [1])]),
    ("plain_async-forward-2x", [("straggler", [1])]),
    ("plain-optimizer-2x", [("straggler", [3])]),
    ("ddp-optimizer-2x", [("straggler", [3])]),
    ("plain-clean", []),
    ("ddp-clean", []),
]


@pytest.mark.parametrize("mode", ["offline", "online"])
@pytest.mark.parametrize(("case", "expected"), CASES)
def test_a_rank_slow_on_its_device_is_named(
    case: str, expected: list[tuple[str, list[int]]], mode: str
) -> None:
    assert named(analyse(mode, recorded.records(DATA / case))) == expected


def test_the_recordings_carry_the_devices_times() -> None:
    """On CUDA the wait is the collectives' device time and the data time the device's idle
    part: the slow rank waits least, and its data time is no longer its spin."""
    records = recorded.records(DATA / "plain-optimizer-2x")
    late = {r.rank: r for r in records if isinstance(r, schema.StepRecord) and r.step == 30}
    base = sum(r.end_s - r.start_s for r in late.values()) / len(late)
    assert late[3].comm_wait_s < min(late[r].comm_wait_s for r in (0, 1, 2))
    assert late[3].data_s < 0.1 * base
