"""`vigil analyze` over a restarted job's folder: the attempts section from per-attempt files and
the controller's record; the detectors see each step as its newest attempt trained it."""

from __future__ import annotations

from pathlib import Path

import msgspec

from vigil import codec, schema
from vigil.analyzer import attempts, offline, report

JOB = "j"
CRASH = "crash-abc-a0-r1"


def _step(rank: int, step: int, t: float) -> schema.StepRecord:
    return schema.StepRecord(job_id=JOB, rank=rank, step=step, start_s=t, end_s=t + 1.0)


def _write(path: Path, records: list[schema.Record]) -> None:
    path.write_bytes(b"".join(codec.encode_json(r) + b"\n" for r in records))


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / JOB
    folder.mkdir()
    for rank in (0, 1):  # attempt 0: steps 0-5 (rank 1 died in 6); attempt 1: steps 4-9
        _write(folder / f"rank-0000{rank}.jsonl", [_step(rank, s, 100.0 + s) for s in range(6)])
        _write(
            folder / f"rank-0000{rank}.attempt-1.jsonl",
            [_step(rank, s, 200.0 + s) for s in range(4, 10)],
        )
    crash = schema.Finding(
        finding_id=CRASH,
        kind=schema.FindingKind.CRASH,
        job_id=JOB,
        subjects=schema.Subjects(ranks=[1], nodes=["node-0"]),
        step_start=6,
        step_end=6,
        summary="rank 1 on node-0 was killed by SIGKILL in step 6 (attempt 0; first of 2 to exit)",
        evidence=[schema.Evidence(metric="exit_code", observed=-9.0)],
        detected_s=107.0,
    )
    restart = schema.Action(
        action_id=f"{CRASH}/0-restart",
        kind=schema.ActionKind.RESTART,
        job_id=JOB,
        finding_id=CRASH,
        state=schema.ActionState.SUCCEEDED,
        start_s=107.5,
        end_s=108.0,
        result="attempt 1 on node-0 (world size 2)",
        attempt=1,
    )
    recovered = msgspec.structs.replace(restart, resume_step=4, steps_lost=2, recovered_s=205.0)
    _write(folder / "controller.jsonl", [crash, restart, recovered])
    return folder


def test_each_attempt_its_crash_and_its_restart_are_shown(tmp_path: Path) -> None:
    result = offline.analyze_path(_folder(tmp_path))
    first, second = result.attempts
    assert (first.attempt, first.first_step, first.last_step, first.ranks) == (0, 0, 5, 2)
    assert first.crash is not None and first.crash.finding_id == CRASH
    assert first.restart is None
    assert (second.attempt, second.first_step, second.last_step) == (1, 4, 9)
    assert second.restart is not None and second.restart.steps_lost == 2
    # The controller's crash is a finding; the crash rule's guess from the records is not kept.
    crashes = [f for f in result.findings if f.kind is schema.FindingKind.CRASH]
    assert [f.finding_id for f in crashes] == [CRASH]
    text = report.to_text(result)
    assert "attempt 0 of j: steps 0-5 on 2 rank(s)" in text
    assert "crash: rank 1 on node-0 was killed by SIGKILL in step 6" in text
    assert "resumed at step 4, 2 step(s) lost (steps 4-5 trained again)" in text
    assert "recovered 98.0 s after the failure was found" in text
    doc = report.to_dict(result)
    assert doc["attempts"][1]["restart"]["resume_step"] == 4
    assert doc["attempts"][0]["crash"]["exit_code"] == -9
    assert [a["action_id"] for a in doc["actions"]] == [f"{CRASH}/0-restart"]


def test_detectors_see_each_step_as_its_newest_attempt_trained_it() -> None:
    tagged: list[tuple[int, schema.Record]] = [
        (0, _step(0, 4, 104.0)),
        (0, _step(0, 5, 105.0)),
        (1, _step(0, 4, 204.0)),
        (1, schema.RankInfo(job_id=JOB, rank=0, node="node-0")),
    ]
    kept = attempts.latest_steps(tagged)
    steps = [(r.step, r.start_s) for r in kept if isinstance(r, schema.StepRecord)]
    assert steps == [(5, 105.0), (4, 204.0)]
    assert any(isinstance(r, schema.RankInfo) for r in kept)


def test_a_job_that_ran_once_has_no_attempts_section(tmp_path: Path) -> None:
    folder = tmp_path / JOB
    folder.mkdir()
    _write(folder / "rank-00000.jsonl", [_step(0, s, 100.0 + s) for s in range(5)])
    result = offline.analyze_path(folder)
    assert result.attempts == [] and "Attempts" not in report.to_text(result)
    assert offline.attempt_of(Path("rank-00003.attempt-12.jsonl")) == 12
    assert offline.attempt_of(Path("rank-00003.jsonl")) == 0


def _beat(rank: int, t: float, seq: int, state: schema.RankState) -> schema.Heartbeat:
    return schema.Heartbeat(
        job_id=JOB, rank=rank, time_s=t, last_step=0, last_group="world", last_seq=seq,
        last_op="all_reduce", state=state,
    )  # fmt: skip


def test_a_job_its_launcher_restarted_has_each_attempts_crash_and_hang(tmp_path: Path) -> None:
    """torchrun --max-restarts, no controller: attempt 0's rank 3 dies after step 9 (its peers
    fail); attempt 1 starts over at step 0 and its rank 1 stops before step 10 for good."""
    folder = tmp_path / JOB
    folder.mkdir()
    failed, computing = schema.RankState.FAILED, schema.RankState.COMPUTE
    waiting = schema.RankState.IN_COLLECTIVE
    for rank in range(4):
        first: list[schema.Record] = [_step(rank, s, 100.0 + s) for s in range(10)]
        first += [_beat(rank, 100.5 + s, s + 1, computing) for s in range(10)]
        if rank != 3:  # rank 3 vanished; its peers' all-reduce broke
            first.append(_beat(rank, 110.6, 11, failed))
        _write(folder / f"rank-0000{rank}.jsonl", first)
        second: list[schema.Record] = [_step(rank, s, 200.0 + s) for s in range(10)]
        second += [_beat(rank, 200.5 + s, s + 1, computing) for s in range(10)]
        for t in range(210, 220):  # rank 1 never enters #11; its peers wait in it
            state = computing if rank == 1 else waiting
            second.append(_beat(rank, float(t), 10 if rank == 1 else 11, state))
        _write(folder / f"rank-0000{rank}.attempt-1.jsonl", second)
    found = sorted(
        (f.kind.value, f.subjects.ranks, f.step_start)
        for f in offline.analyze_path(folder).findings
    )
    assert found == [("crash", [3], 10), ("hang", [1], 10)], found
