"""The attempt record: where a failed attempt stopped, where the next resumed, the steps lost,
and the controller's crash finding and restart action that carry them (fast: no processes)."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest

from tests.recovery.fakes import FakeExecutor, FakeWatch, Recorder
from vigil import codec
from vigil.recovery import attempts, controller, diagnosis, journal, placement, policy
from vigil.recovery.attempts import FirstStep
from vigil.recovery.executor import RankExit
from vigil.schema import (
    Action,
    ActionKind,
    ActionState,
    DiagResult,
    Evidence,
    Finding,
    FindingKind,
    StepRecord,
    Subjects,
    Verdict,
)


@pytest.mark.parametrize(
    ("last", "resume", "lost"),
    [
        (11, 12, 0),  # resumed from a snapshot of the last step: nothing redone
        (11, 11, 1),  # the snapshot one step behind: step 11 again
        (11, 9, 3),  # from a checkpoint at 8: steps 9, 10, 11 again
        (-1, 0, 0),  # died before finishing a step: nothing to lose
        (None, 5, -1),  # where the failed attempt got to is not known
        (4, 7, 0),  # resumed past it (the job skipped ahead): no step trained twice
    ],
)
def test_steps_lost_counts_the_steps_trained_twice(
    last: int | None, resume: int, lost: int
) -> None:
    assert attempts.steps_lost(last, resume) == lost


def test_records_file_names_carry_their_attempt() -> None:
    assert attempts.records_file_attempt(Path("rank-00002.jsonl")) == 0
    assert attempts.records_file_attempt(Path("rank-00002.attempt-3.jsonl")) == 3
    assert attempts.records_file_attempt(Path("controller.jsonl")) is None


def _steps(path: Path, rank: int, steps: range, start_s: float, job: str = "j") -> None:
    with path.open("ab") as f:
        for i, step in enumerate(steps):
            t = start_s + i
            f.write(
                codec.encode_json(
                    StepRecord(job_id=job, rank=rank, step=step, start_s=t, end_s=t + 0.5)
                )
                + b"\n"
            )


def test_progress_watch_reads_the_attempts_own_files_exactly(tmp_path: Path) -> None:
    records = tmp_path / "out" / "j"
    records.mkdir(parents=True)
    _steps(records / "rank-00000.jsonl", 0, range(0, 8), 100.0)
    _steps(records / "rank-00001.jsonl", 1, range(0, 7), 100.0)
    watch = attempts.ProgressWatch(job_id="j", records_dir=records)
    assert watch.last_steps(0, 100.0) == {0: 7, 1: 6}
    assert watch.first_step(1, 120.0) is None  # attempt 1 has no file yet
    # Attempt 1 resumes at step 5; rank 1 finishes it first. A line still being written waits.
    _steps(records / "rank-00000.attempt-1.jsonl", 0, range(5, 9), 121.0)
    _steps(records / "rank-00001.attempt-1.jsonl", 1, range(5, 6), 120.5)
    with (records / "rank-00001.attempt-1.jsonl").open("ab") as f:
        f.write(b'{"type":"step","job_id":"j","rank":1,"step":2')
    assert watch.first_step(1, 120.0) == FirstStep(5, 121.0, "records")
    # Another job's records in the folder, and records from before the attempt began, are not it.
    _steps(records / "rank-00002.attempt-2.jsonl", 2, range(0, 3), 90.0)
    _steps(records / "rank-00002.attempt-2.jsonl", 2, range(0, 3), 130.0, job="other")
    assert watch.first_step(2, 120.0) is None


def test_progress_watch_asks_the_collector_when_the_job_has_no_files(tmp_path: Path) -> None:
    asked: list[float] = []

    def remote(since_s: float) -> FirstStep | None:
        asked.append(since_s)
        return FirstStep(7, 130.0, "collector") if len(asked) > 1 else None

    watch = attempts.ProgressWatch(job_id="j", records_dir=tmp_path / "none", remote=remote)
    assert watch.first_step(1, 120.0) is None  # not there yet (nor any page): wait
    assert watch.first_step(1, 120.0) == FirstStep(7, 130.0, "collector")
    assert asked == [120.0, 120.0]


def _exit(rank: int, code: int, node: str = "node-0") -> RankExit:
    return RankExit(rank=rank, node=node, returncode=code, seen_s=50.0)


def _controller(
    tmp_path: Path,
    executor: FakeExecutor,
    watch: FakeWatch | None,
    sink: Recorder,
    findings: list[Finding] | None = None,
) -> controller.Controller:
    ticks = itertools.count(1000.0, 0.5)

    class Source:
        def fetch(self) -> list[Finding]:
            out, findings[:] = list(findings or []), []
            return out

    return controller.Controller(
        config=controller.ControllerConfig(
            job_id="j", run_id="r", replay_interval_s=2.0, budget=policy.Budget(cooldown_s=0.0)
        ),
        executor=executor,
        journal=journal.Journal(tmp_path / "ctl"),
        placement=placement.Placement.build(nproc=4, nodes=2, spare=1),
        findings=Source() if findings is not None else None,
        sink=sink,
        steps=watch,
        clock=lambda: next(ticks),
        sleep=lambda _s: None,
    )


def test_a_crash_and_its_restart_are_on_record_with_resume_step_and_steps_lost(
    tmp_path: Path,
) -> None:
    def script(attempt: int, polls: int) -> list[RankExit]:
        if attempt == 0 and polls == 3:
            return [_exit(1, -9)]
        if attempt == 1 and polls == 6:
            return [_exit(r, 0) for r in range(4)]
        return []

    # Attempt 0: rank 1 finished step 4 and died in 5; rank 0 logged 5 (it failed under it).
    watch = FakeWatch(last={0: {0: 5, 1: 4, 2: 4, 3: 4}}, first={1: FirstStep(3, 1234.5, "x")})
    sink = Recorder()
    ctl = _controller(tmp_path, FakeExecutor(script), watch, sink)
    assert ctl.run() == 0
    crash = next(r for r in sink.records if isinstance(r, Finding))
    assert crash.kind is FindingKind.CRASH and crash.subjects.ranks == [1]
    assert (crash.step_start, crash.step_end) == (5, 5)
    assert "rank 1 on node-0 was killed by SIGKILL in step 5" in crash.summary
    assert {e.metric: e.observed for e in crash.evidence}["last_step"] == 4
    restart_id = f"{crash.finding_id}/0-restart"
    posts = sink.actions(restart_id)
    states = [(p.state, p.attempt, p.resume_step, p.steps_lost) for p in posts]
    # Planned, running, relaunched as attempt 1, then its first step: resumed at 3, 4 - 3 + 1
    # = 2 steps lost (steps 3 and 4 were trained before the crash).
    assert states == [
        (ActionState.PENDING, -1, -1, -1),
        (ActionState.RUNNING, -1, -1, -1),
        (ActionState.SUCCEEDED, 1, -1, -1),
        (ActionState.SUCCEEDED, 1, 3, 2),
    ]
    assert posts[-1].recovered_s == 1234.5 and posts[-1].end_s == posts[-2].end_s
    # The journal keeps the final record, so a restarted controller does not post it again.
    assert journal.Journal(tmp_path / "ctl").get(restart_id) == posts[-1]
    assert sink.replays >= 1  # spooled posts are retried on the loop's timer


def test_without_a_watch_the_record_says_unknown(tmp_path: Path) -> None:
    def script(attempt: int, polls: int) -> list[RankExit]:
        if attempt == 0 and polls == 2:
            return [_exit(2, 3, "node-1")]
        return [_exit(r, 0) for r in range(4)] if attempt == 1 and polls == 2 else []

    sink = Recorder()
    assert _controller(tmp_path, FakeExecutor(script), None, sink).run() == 0
    crash = next(r for r in sink.records if isinstance(r, Finding))
    assert "exited with code 3 (attempt 0" in crash.summary and crash.step_start == -1
    final = [a for a in sink.records if isinstance(a, Action)][-1]
    assert (final.attempt, final.resume_step, final.steps_lost) == (1, -1, -1)


def _crash_after(clean: dict[int, int], tmp_path: Path) -> Finding:
    """Attempt 0: rank 3 exits cleanly, then ranks 0-2 exit with code 1; `clean`: each rank's
    last finished step. Attempt 1 finishes."""

    def script(attempt: int, polls: int) -> list[RankExit]:
        if attempt == 0 and polls == 2:
            return [_exit(3, 0, "node-1")]
        if attempt == 0 and polls == 3:
            return [RankExit(rank=r, node="node-0", returncode=1, seen_s=50.7) for r in range(3)]
        return [_exit(r, 0) for r in range(4)] if attempt == 1 and polls == 2 else []

    sink = Recorder()
    watch = FakeWatch(last={0: clean}, first={1: FirstStep(0, 60.0, "x")})
    assert _controller(tmp_path, FakeExecutor(script), watch, sink).run() == 0
    return next(r for r in sink.records if isinstance(r, Finding))


def test_a_rank_that_left_its_loop_early_is_the_crash_culprit(tmp_path: Path) -> None:
    """Rank 3's data ran out after step 29 (uneven shards): it exited cleanly while its peers
    went on into step 30, whose all-reduce then broke under them."""
    crash = _crash_after({0: 30, 1: 30, 2: 30, 3: 29}, tmp_path)
    assert crash.subjects.ranks == [3] and crash.subjects.nodes == ["node-1"]
    assert "rank 3 on node-1 left its training loop after step 29" in crash.summary
    assert "then rank 0 on node-0 exited with code 1" in crash.summary
    assert (crash.step_start, crash.step_end) == (30, 30)


def test_ranks_that_finished_together_leave_the_crash_to_the_first_to_fail(
    tmp_path: Path,
) -> None:
    """Every rank finished step 30; rank 3 exited first, then rank 0 failed in its own code."""
    crash = _crash_after({r: 30 for r in range(4)}, tmp_path)
    assert crash.subjects.ranks == [0] and "first of 3 to exit" in crash.summary


def _diag(node: str, verdict: Verdict) -> list[DiagResult]:
    return [
        DiagResult(node=node, device="cpu", test="sdc.mismatches", value=0.0, verdict=Verdict.PASS),
        DiagResult(node=node, device="cpu", test="memtest.failing_words", value=12.0,
                   unit="count", verdict=verdict),
    ]  # fmt: skip


def _diagnosed() -> None:
    """Wait for the controller's background diagnoses to end."""
    for thread in threading.enumerate():
        if thread.name.startswith("vigil-diagnose"):
            thread.join(timeout=10)


def _mfu_drop(node: str) -> Finding:
    return Finding(
        finding_id=f"mfu-{node}",
        kind=FindingKind.MFU_DROP,
        job_id="j",
        subjects=Subjects(ranks=[2], nodes=[node]),
        detected_s=5000.0,
    )


def test_a_failing_diagnosis_cordons_the_node_and_no_restart_lands_on_it(tmp_path: Path) -> None:
    def script(attempt: int, polls: int) -> list[RankExit]:
        if attempt == 0 and polls == 4:
            _diagnosed()  # the diagnosis ran in the background and ended
            return [_exit(0, -9)]  # later, an unrelated crash: restart in place
        return [_exit(r, 0) for r in range(4)] if attempt == 1 and polls == 2 else []

    executor = FakeExecutor(script, diagnostics={"node-1": _diag("node-1", Verdict.FAIL)})
    sink = Recorder()
    ctl = _controller(tmp_path, executor, FakeWatch(), sink, findings=[_mfu_drop("node-1")])
    assert ctl.run() == 0
    assert executor.diagnosed == ["node-1"] and executor.cordoned == ["node-1"]
    diagnose = sink.actions("mfu-node-1/0-diagnose")[-1]
    assert diagnose.state is ActionState.SUCCEEDED
    assert diagnose.result.startswith("node-1: fail (2 results: 1 pass, 1 fail")
    assert "memtest.failing_words 12 count" in diagnose.result
    assert diagnose.result.endswith("; cordoned")
    # Each result is on record.
    assert [r.test for r in sink.records if isinstance(r, DiagResult)] == [
        "sdc.mismatches",
        "memtest.failing_words",
    ]
    # The crash's restart moved node-1's ranks to the spare (and dropped node-1's snapshots).
    (first, _), (second, moved) = executor.launched
    assert (first, second) == (0, 1)
    assert moved.active == ("node-0", "node-2") and "node-1" in moved.cordoned
    assert "node-1" in executor.forgotten


def test_a_passing_diagnosis_changes_nothing_and_one_that_cannot_run_fails(
    tmp_path: Path,
) -> None:
    def script(attempt: int, polls: int) -> list[RankExit]:
        return [_exit(r, 0) for r in range(4)] if polls == 4 else []

    executor = FakeExecutor(script, diagnostics={"node-1": _diag("node-1", Verdict.PASS)})
    sink = Recorder()
    found = [_mfu_drop("node-1"), _mfu_drop("node-0")]
    assert _controller(tmp_path, executor, FakeWatch(), sink, findings=found).run() == 0
    assert executor.cordoned == []
    passed = sink.actions("mfu-node-1/0-diagnose")[-1]
    assert passed.state is ActionState.SUCCEEDED and passed.result.startswith("node-1: pass")
    broken = sink.actions("mfu-node-0/0-diagnose")[-1]
    assert broken.state is ActionState.FAILED
    assert broken.result.startswith("node-0: unknown (diagnostics of node-0 failed")


def test_worst_verdict_orders_fail_over_suspect_over_pass() -> None:
    def r(v: Verdict) -> DiagResult:
        return DiagResult(node="n", device="0", test="t", value=1.0, verdict=v)

    assert diagnosis.worst_verdict([r(Verdict.PASS), r(Verdict.FAIL)]) is Verdict.FAIL
    assert diagnosis.worst_verdict([r(Verdict.SUSPECT), r(Verdict.PASS)]) is Verdict.SUSPECT
    assert diagnosis.worst_verdict([r(Verdict.UNKNOWN), r(Verdict.PASS)]) is Verdict.PASS
    assert diagnosis.worst_verdict([r(Verdict.UNKNOWN)]) is Verdict.UNKNOWN
    assert diagnosis.worst_verdict([]) is Verdict.UNKNOWN


def test_placement_avoids_cordoned_nodes_with_spares_then_by_shrinking() -> None:
    p = placement.Placement.build(nproc=6, nodes=3, spare=1).cordon("node-0").cordon("node-2")
    moved = p.avoid_cordoned()
    assert moved.active == ("node-3", "node-1") and moved.spares == ()
    assert moved.world_size == 4 and {"node-0", "node-2"} <= moved.cordoned
    spare_cordoned = placement.Placement.build(nproc=2, nodes=1, spare=1).cordon("node-1")
    assert spare_cordoned.spares == () and spare_cordoned.avoid_cordoned() == spare_cordoned
    with pytest.raises(ValueError, match="no active node would remain"):
        placement.Placement.build(nproc=2, nodes=1).cordon("node-0").avoid_cordoned()


def test_restart_kind_is_recorded_for_migrations_too(tmp_path: Path) -> None:
    """Two crashes of one node: the second restart is a migration, with its attempt."""

    def script(attempt: int, polls: int) -> list[RankExit]:
        if attempt < 2 and polls == 2:
            return [_exit(3, 1, "node-1")]
        return [_exit(r, 0) for r in range(4)] if attempt == 2 and polls == 3 else []

    sink = Recorder()
    watch = FakeWatch(delay=0, first={1: FirstStep(0, 1.0, "x"), 2: FirstStep(0, 2.0, "x")})
    assert _controller(tmp_path, FakeExecutor(script), watch, sink).run() == 0
    finals = {a.action_id: a for a in sink.records if isinstance(a, Action)}
    kinds = sorted((a.attempt, a.kind) for a in finals.values())
    assert kinds == [(1, ActionKind.RESTART), (2, ActionKind.MIGRATE)]


class _MovingWatch(FakeWatch):
    """A healthy job that trains on while its recovery begins: later reads see later steps."""

    def last_steps(self, attempt: int, since_s: float) -> dict[int, int]:
        self.reads = getattr(self, "reads", 0) + 1
        step = 10 if self.reads == 1 else 12
        return dict.fromkeys(range(4), step) if attempt == 0 else {}


def test_a_moved_job_counts_the_steps_it_trained_until_it_was_stopped(tmp_path: Path) -> None:
    def script(attempt: int, polls: int) -> list[RankExit]:
        return [_exit(r, 0) for r in range(4)] if attempt == 1 and polls == 4 else []

    straggler = Finding(
        finding_id="slow-2",
        kind=FindingKind.STRAGGLER,
        job_id="j",
        subjects=Subjects(ranks=[2], nodes=["node-1"]),
        evidence=[Evidence(metric=policy.SLOWDOWN_METRIC, observed=2.5)],
        confidence=0.9,
        detected_s=5000.0,
    )
    executor = FakeExecutor(script, diagnostics={"node-1": _diag("node-1", Verdict.PASS)})
    watch = _MovingWatch(delay=0, first={1: FirstStep(11, 7000.0, "x")})
    sink = Recorder()
    assert _controller(tmp_path, executor, watch, sink, findings=[straggler]).run() == 0
    actions = {a.action_id: a for a in sink.records if isinstance(a, Action)}
    assert [a.kind for a in actions.values()] == [
        ActionKind.CHECKPOINT,
        ActionKind.DIAGNOSE,
        ActionKind.MIGRATE,
    ]
    migrate = actions["slow-2/2-migrate"]
    # Stopped after step 12, resumed at 11: steps 11 and 12 again (not the 10 seen at first).
    assert (migrate.attempt, migrate.resume_step, migrate.steps_lost) == (1, 11, 2)
    assert executor.launched[1][1].active == ("node-0", "node-2")


def test_a_diagnosis_runs_beside_the_loop_which_still_handles_a_crash(tmp_path: Path) -> None:
    """The quick suite takes a minute on a GPU node: meanwhile a crash is still recovered."""
    release = threading.Event()

    class SlowDiagnosis(FakeExecutor):
        def diagnose(self, node: str, *, timeout_s: float) -> list[DiagResult]:
            release.wait(timeout=10)
            return super().diagnose(node, timeout_s=timeout_s)

    def script(attempt: int, polls: int) -> list[RankExit]:
        if attempt == 0 and polls == 3:
            return [_exit(3, -9, "node-1")]
        if attempt == 1 and polls == 2:
            release.set()  # the restart happened while node-1 was being diagnosed
        if attempt == 1 and polls == 4:
            _diagnosed()
        return [_exit(r, 0) for r in range(4)] if attempt == 1 and polls == 6 else []

    executor = SlowDiagnosis(script, diagnostics={"node-1": _diag("node-1", Verdict.PASS)})
    sink = Recorder()
    assert (
        _controller(tmp_path, executor, FakeWatch(), sink, findings=[_mfu_drop("node-1")]).run()
        == 0
    )
    finals = {a.action_id: a for a in sink.records if isinstance(a, Action)}
    diagnose = finals["mfu-node-1/0-diagnose"]
    restart = next(a for a in finals.values() if a.kind in policy.RESTARTING)
    assert diagnose.state is ActionState.SUCCEEDED and diagnose.start_s < restart.end_s
    assert diagnose.end_s > restart.end_s
