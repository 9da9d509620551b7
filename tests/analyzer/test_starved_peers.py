"""Peers whose wait for a CPU fell inside their collectives do not make the one rank that was not
starved a straggler.

data/jsonl_starved_peers/ holds steps 370-469 of a real fault-free 4-rank gloo job
(`tests/realjobs/train.py`, tensor parallelism, a busy process bound to each of the host's 2
cores, 1,500 steps), the SDK's own JSONL. Around steps 423-433 ranks 0, 2 and 3 waited 15-35
ms a step for a CPU, mostly while blocked in their collectives (their communication wait, data
time and CPU wait add up to more than their step), while rank 1 computed ~16 ms a step, ~1.6x
its usual. Clipped at 0, the peers' compute read ~4 ms in the median, and rank 1 was reported
as a compute straggler at 4.18x the median, offline and online. Compute is now unknown where
it would be clipped so (`StepArrays.known_compute_s`), and the straggler scores leave those
steps out. With compute read as before, the same data must still raise the finding: it is that
rule that keeps the job quiet, not a change of the data.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.analyzer import recorded
from vigil.analyzer import arrays

JOB = recorded.DATA / "jsonl_starved_peers" / "tp-long-clean-cpu_hog"
EPISODE = range(423, 434)  # steps of the episode reported before
NOT_STARVED = 1


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_starved_peers_do_not_make_a_straggler(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    records = recorded.records(JOB)
    assert recorded.named(recorded.analyse(mode, records)) == []
    # Compute clipped at 0 where the wait for a CPU overlapped communication, as before:
    monkeypatch.setattr(arrays.StepArrays, "known_compute_s", arrays.StepArrays.compute_s)
    assert recorded.named(recorded.analyse(mode, records)) == [("straggler", [NOT_STARVED])]


def test_compute_is_unknown_exactly_where_the_wait_for_a_cpu_overlapped() -> None:
    a = arrays.from_records(recorded.records(JOB))
    assert a.cpu_wait_s is not None
    cpu_wait = np.nan_to_num(a.cpu_wait_s)
    remainder = a.step_time_s - a.comm_wait_s - a.data_s - cpu_wait
    overlapped = (remainder < 0) & (cpu_wait > 0)
    known = a.known_compute_s()
    np.testing.assert_array_equal(np.isnan(known), overlapped)
    np.testing.assert_array_equal(known[~overlapped], a.compute_s()[~overlapped])
    assert np.all(a.compute_s()[overlapped] == 0.0)  # what the scores used to read
    # In the episode the peers' compute is mostly unknown, the unstarved rank's known.
    rows = np.isin(a.steps, list(EPISODE))
    peers = np.arange(a.num_ranks) != NOT_STARVED
    assert overlapped[np.ix_(rows, peers)].mean() > 0.4
    assert not overlapped[rows, NOT_STARVED].any()
    assert a.known_compute_s() is known  # cached, as compute_s is
