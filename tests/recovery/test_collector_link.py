"""The controller's posts go through the core sender: a 5xx is retried, a collector that is away
costs nothing but a spooled record (publish never raises), and the spool is sent, oldest first
and under the same batch ids, before the next post or by the next controller.

Real HTTP on loopback to `tests.agent.receiver.Receiver` (the ingest contract).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.agent import conftest, receiver
from tests.recovery.fakes import FakeExecutor
from vigil import spool
from vigil.recovery import collector_link, controller, journal, placement, policy
from vigil.recovery.executor import RankExit
from vigil.schema import Action, ActionKind, ActionState, Finding, FindingKind

pytestmark = pytest.mark.integration


def _action(state: ActionState, index: int = 0) -> Action:
    return Action(
        action_id=f"crash-a0-r1/{index}-restart",  # controller ids hold '/'
        kind=ActionKind.RESTART,
        job_id="j",
        finding_id="crash-a0-r1",
        state=state,
    )


def _sink(
    url: str, spool_dir: Path, waits: list[float] | None = None
) -> collector_link.CollectorActions:
    sleep = waits.append if waits is not None else (lambda _s: None)
    return collector_link.CollectorActions(url=url, spool_dir=spool_dir, timeout_s=2.0, sleep=sleep)


def _states(collector: receiver.Receiver) -> list[str]:
    return [r.state.value for r in collector.records if isinstance(r, Action)]


def test_posts_while_the_collector_is_away_go_before_the_next_one(tmp_path: Path) -> None:
    port = conftest.free_port()
    sink = _sink(f"http://127.0.0.1:{port}", tmp_path / "posts.spool")
    sink.publish(_action(ActionState.PENDING))  # nobody listens: spooled, no exception
    sink.publish(_action(ActionState.RUNNING))
    collector = receiver.Receiver(port)
    try:
        sink.publish(_action(ActionState.SUCCEEDED))
        assert _states(collector) == ["pending", "running", "succeeded"]  # in the order acted
        assert collector.batch_ids == [
            f"action-crash-a0-r1/0-restart-{s}" for s in ("pending", "running", "succeeded")
        ]
    finally:
        sink.close()
        collector.stop()
    assert list((tmp_path / "posts.spool").glob("*.vgl")) == []


def test_a_server_error_is_retried_with_the_core_backoff(tmp_path: Path) -> None:
    collector = receiver.Receiver(fail_first=1)  # one 503, then 200
    waits: list[float] = []
    try:
        sink = _sink(collector.url, tmp_path / "posts.spool", waits)
        finding = Finding(finding_id="crash-a0-r1", kind=FindingKind.CRASH, job_id="j")
        sink.publish(finding)
        assert waits == [0.2] and collector.requests == 2
        assert [r.finding_id for r in collector.records] == ["crash-a0-r1"]  # type: ignore[union-attr]
        assert collector.batch_ids == ["finding-crash-a0-r1"]
        sink.close()
    finally:
        collector.stop()


def test_a_restarted_controller_sends_what_the_last_one_left(tmp_path: Path) -> None:
    port = conftest.free_port()
    url, posts = f"http://127.0.0.1:{port}", tmp_path / "posts.spool"
    before = _sink(url, posts)
    before.publish(_action(ActionState.PENDING))
    before.close()  # the controller stops with the collector still away
    collector = receiver.Receiver(port)
    try:
        after = _sink(url, posts)
        assert after.replay()  # the collector is back: the spool goes without a new post
        assert _states(collector) == ["pending"]
        after.close()
    finally:
        collector.stop()


_LEAVE_A_SPOOLED_POST = """
import os, sys
from vigil.recovery import collector_link
from vigil.schema import Action, ActionKind
sink = collector_link.CollectorActions(url=sys.argv[1], spool_dir=sys.argv[2], attempts=1)
sink.publish(Action(action_id="other/0-cordon", kind=ActionKind.CORDON, job_id="j"))
os._exit(0)
"""


def test_a_controller_that_died_leaves_its_posts_to_the_next(tmp_path: Path) -> None:
    port = conftest.free_port()
    url, posts = f"http://127.0.0.1:{port}", tmp_path / "posts.spool"
    holder = spool.Spool(
        posts, max_bytes=1 << 20
    )  # the folder is busy: the dying one uses a sibling
    run = [sys.executable, "-c", _LEAVE_A_SPOOLED_POST, url, str(posts)]
    subprocess.run(run, check=True, timeout=60)
    holder.close()
    (sibling,) = spool.siblings(posts)[1:]
    collector = receiver.Receiver(port)
    try:
        sink = _sink(url, posts)
        sink.publish(_action(ActionState.PENDING))
        assert [r.action_id for r in collector.records] == [  # type: ignore[union-attr]
            "crash-a0-r1/0-restart",
            "other/0-cordon",
        ]
        sink.close()
    finally:
        collector.stop()
    assert not sibling.exists()


def test_a_restart_is_posted_again_with_its_recovery_record(tmp_path: Path) -> None:
    collector = receiver.Receiver()
    try:
        sink = _sink(collector.url, tmp_path / "posts.spool")
        relaunched = msgspec.structs.replace(_action(ActionState.SUCCEEDED), attempt=1)
        sink.publish(relaunched)
        sink.publish(
            msgspec.structs.replace(relaunched, resume_step=7, steps_lost=1, recovered_s=9.0)
        )
        sink.publish(relaunched)  # the same post again (a retry): stored once
        assert collector.batch_ids == [
            "action-crash-a0-r1/0-restart-succeeded",
            "action-crash-a0-r1/0-restart-succeeded-resumed7",
        ]
        last = collector.records[-1]
        assert isinstance(last, Action) and (last.resume_step, last.steps_lost) == (7, 1)
        sink.close()
    finally:
        collector.stop()


def test_the_controllers_loop_sends_spooled_posts_on_a_timer(tmp_path: Path) -> None:
    """The collector is away when a rank crashes and comes back while the job runs on: the crash
    and its restart reach it from the loop's timer, with no further post to carry them."""
    port = conftest.free_port()
    url = f"http://127.0.0.1:{port}"
    started: list[receiver.Receiver] = []
    seen_during_run: list[int] = []

    def script(attempt: int, polls: int) -> list[RankExit]:
        if attempt == 0 and polls == 2:
            return [RankExit(rank=1, node="node-0", returncode=-9, seen_s=1.0)]
        if attempt == 1 and polls == 3:
            started.append(receiver.Receiver(port))
        if attempt == 1 and polls == 30:
            seen_during_run.append(len(started[0].records))
            return [RankExit(rank=r, node="node-0", returncode=0, seen_s=2.0) for r in range(2)]
        return []

    sink = _sink(url, tmp_path / "posts.spool")
    ticks = itertools.count(100.0, 0.5)
    ctl = controller.Controller(
        config=controller.ControllerConfig(
            job_id="j", run_id="r", replay_interval_s=3.0, budget=policy.Budget(cooldown_s=0.0)
        ),
        executor=FakeExecutor(script),
        journal=journal.Journal(tmp_path / "ctl"),
        placement=placement.Placement.build(nproc=2, nodes=1, spare=0),
        sink=sink,
        clock=lambda: next(ticks),
        sleep=lambda _s: None,
    )
    try:
        assert ctl.run() == 0
        # Finding, then the restart's pending, running and succeeded states, all before the end.
        assert seen_during_run == [4]
        kinds = [type(r).__name__ for r in started[0].records]
        assert kinds == ["Finding", "Action", "Action", "Action"]
    finally:
        sink.close()
        for r in started:
            r.stop()
