"""`PageCheckpointer` (checkpoint now through the local ranks' progress pages) reports what it
saw: the step of a checkpoint committed after the request when the job tells its commits, and
otherwise only the acknowledgements, never that a checkpoint committed. A real SDK rank
(in this process, its training loop on a thread) answers the request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import vigil.agent
from vigil.recovery.checkpoint_request import PageCheckpointer


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[tuple[Path, list[int]]]:
    """A training loop whose checkpoint callback 'commits' at the step it runs in."""
    pages = tmp_path / "pages"
    vigil.agent.init(
        job="ckreq", output_dir=tmp_path / "out", progress_dir=pages, rank=0, world_size=1,
        measure_cpu_peak=False, flush_interval_s=0.05,
    )  # fmt: skip
    step, committed = [0], [-1]
    vigil.agent.on_control("checkpoint", lambda: committed.__setitem__(0, step[0]))
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.02):
            step[0] += 1
            with vigil.agent.step(step[0], tokens=1):
                pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield pages, committed
    finally:
        stop.set()
        thread.join(10)
        vigil.agent.shutdown()


def test_a_commit_after_the_request_is_named(rank: tuple[Path, list[int]]) -> None:
    pages, committed = rank
    checkpointer = PageCheckpointer(
        job_id="ckreq", progress_dir=pages, latest_committed=lambda: committed[0]
    )
    outcome = checkpointer.request(timeout_s=20)
    assert (outcome.acked, outcome.asked) == (1, 1)
    assert outcome.committed and outcome.committed_step == committed[0] > 0
    assert outcome.describe(20).startswith("requested, acknowledged by 1 of 1 ranks, committed")


def test_without_commit_tracking_an_acknowledgement_is_not_a_commit(
    rank: tuple[Path, list[int]],
) -> None:
    pages, _ = rank
    outcome = PageCheckpointer(job_id="ckreq", progress_dir=pages).request(timeout_s=20)
    assert (outcome.acked, outcome.asked, outcome.committed) == (1, 1, False)
    assert "not known to have committed" in outcome.describe(20)


def test_no_live_rank_is_an_error_not_a_wait(tmp_path: Path) -> None:
    outcome = PageCheckpointer(job_id="nobody", progress_dir=tmp_path).request(timeout_s=30)
    assert not outcome.committed and outcome.describe(30).startswith("not requested: no live")
