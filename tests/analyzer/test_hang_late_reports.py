"""Hang attribution when a waiting rank reports late (a loaded CPU delays its flusher thread, or
its shipper retries after a collector restart): its stale position must not make it a culprit.

The records are shaped like those a 4-rank data-parallel job ships: each rank's step records and
collective aggregates (one all-reduce per step in group "world"), and one heartbeat a second.
Rank 2 stops before step 16; ranks 0, 1 and 3 enter step 16's all-reduce and wait there.
"""

from __future__ import annotations

from vigil import schema
from vigil.analyzer import config, engine, streaming

JOB = "late-reports"
RANKS = 4
STEP_S = 0.25
HUNG_AT = 16
T0 = 1_000.0
LAST_END = T0 + HUNG_AT * STEP_S  # step 15 ends here on every rank: the last progress


def _history() -> list[schema.Record]:
    """The job's first 16 steps as the ranks ship them, with a heartbeat each second."""
    records: list[schema.Record] = [schema.Job(job_id=JOB, world_size=RANKS)]
    for step in range(HUNG_AT):
        for rank in range(RANKS):
            start = T0 + step * STEP_S
            records.append(
                schema.StepRecord(
                    job_id=JOB, rank=rank, step=step, start_s=start, end_s=start + STEP_S
                )
            )
            records.append(
                schema.CollectiveAggregate(
                    job_id=JOB, rank=rank, step=step, group="world", op="all_reduce", count=1,
                    last_seq=step,
                )
            )  # fmt: skip
    return records


def _beat(rank: int, time_s: float, *, waiting: bool) -> schema.Heartbeat:
    return schema.Heartbeat(
        job_id=JOB,
        rank=rank,
        time_s=time_s,
        last_step=HUNG_AT - 1,
        last_group="world",
        last_seq=HUNG_AT if waiting else HUNG_AT - 1,
        last_op="all_reduce",
        state=schema.RankState.IN_COLLECTIVE if waiting else schema.RankState.COMPUTE,
    )


def _hangs(found: list[schema.Finding]) -> list[schema.Finding]:
    return [f for f in found if f.kind is schema.FindingKind.HANG]


def _run(
    analyzer: streaming.StreamingAnalyzer, rank_one_back_s: float, *, kind: str = "hang"
) -> list[schema.Finding]:
    """Let the hang run: ranks 0 and 3 wait and beat each second, rank 2 (the culprit) beats
    from outside the collective; rank 1's last heartbeat was sent 0.1 s after step 15 ended,
    while it still computed step 16, and its next one arrives `rank_one_back_s` later."""
    found = _hangs(list(analyzer.observe(_history())))
    found += _hangs(list(analyzer.observe([_beat(1, LAST_END + 0.1, waiting=False)])))
    return found + _hang_runs(analyzer, rank_one_back_s, kind=kind)


def _hang_runs(
    analyzer: streaming.StreamingAnalyzer, rank_one_back_s: float, *, kind: str = "hang"
) -> list[schema.Finding]:
    found: list[schema.Finding] = []
    t = LAST_END
    while t < LAST_END + 8.0:
        t += 0.5
        beats = [_beat(0, t, waiting=True), _beat(3, t, waiting=True)]
        beats.append(_beat(2, t, waiting=False))
        if t >= LAST_END + rank_one_back_s:
            beats.append(_beat(1, t, waiting=True))
        raised = [*analyzer.observe(beats), *analyzer.tick(t)]
        found += [f for f in raised if f.kind == kind]
    return found


def test_a_waiting_rank_whose_heartbeats_are_late_is_not_named() -> None:
    found = _run(streaming.StreamingAnalyzer(), rank_one_back_s=3.5)
    assert found, "the hang was not found"
    assert [f.subjects.ranks for f in found] == [[2]], [f.summary for f in found]
    hang = found[0]
    assert hang.step_start == HUNG_AT and hang.confidence == 0.95
    silence = next(e for e in hang.evidence if e.metric == "seconds_without_progress")
    assert silence.observed < 8.0  # found while rank 2 still sleeps


def test_a_hang_is_not_held_back_when_every_culprit_reported() -> None:
    """With rank 1's heartbeats on time the hang is raised once the threshold has passed."""
    found = _run(streaming.StreamingAnalyzer(), rank_one_back_s=0.5)
    assert [f.subjects.ranks for f in found] == [[2]]
    silence = next(e for e in found[0].evidence if e.metric == "seconds_without_progress")
    assert silence.observed <= silence.baseline + 0.5  # at the first check past the threshold


def test_a_rank_that_falls_silent_is_a_crash_not_a_hang_culprit() -> None:
    """Rank 1 never beats again while its peers do: it died (the crash detector's rule), and
    the hang is not raised meanwhile with rank 1 among its culprits."""
    assert _run(streaming.StreamingAnalyzer(), rank_one_back_s=60.0) == []
    found = _run(streaming.StreamingAnalyzer(), rank_one_back_s=60.0, kind="crash")
    assert [f.subjects.ranks for f in found] == [[1]], [f.summary for f in found]


def test_a_rank_never_heard_from_is_named_after_a_bounded_wait() -> None:
    """A restarted collector's analyzer knows rank 1 only from stored aggregates and hears
    nothing from it: the hang is not held back for ever; it names rank 1 too, with lower
    confidence, and says its position may be stale."""
    analyzer = streaming.StreamingAnalyzer()
    found = _hangs(list(analyzer.observe(_history())))
    found += _hang_runs(analyzer, rank_one_back_s=60.0)
    assert found and found[0].subjects.ranks == [1, 2]
    assert found[0].confidence < 0.95 and "rank(s) 1 sent no heartbeat" in found[0].summary
    silence = next(e for e in found[0].evidence if e.metric == "seconds_without_progress")
    assert silence.observed <= silence.baseline + 3.5


def test_a_heartbeat_that_arrives_after_a_newer_one_does_not_move_the_rank_back() -> None:
    analyzer = streaming.StreamingAnalyzer()
    found = _hangs(list(analyzer.observe(_history())))
    t = LAST_END
    while t < LAST_END + 6.0:
        t += 0.5
        beats = [_beat(r, t, waiting=True) for r in (0, 1, 3)]
        # A retried shipment: rank 1's heartbeat from just after step 15, outside the collective.
        beats.append(_beat(1, LAST_END + 0.1, waiting=False))
        beats.append(_beat(2, t, waiting=False))
        found += _hangs([*analyzer.observe(beats), *analyzer.tick(t)])
    assert [f.subjects.ranks for f in found] == [[2]], [f.summary for f in found]


def test_offline_a_hang_is_found_as_its_silence_passes_the_threshold() -> None:
    """Heartbeats come 0.2 s past each second of the stall, so the 4 s threshold passes 0.2 s
    before the next one: `vigil analyze` checks then too (as the collector ticks then), not
    at the next heartbeat."""
    records = _history()
    for k in range(8):
        t = LAST_END + 0.2 + k
        records += [_beat(rank, t, waiting=rank != 2) for rank in range(RANKS)]
    found = _hangs(engine.analyze_records(records))
    assert [f.subjects.ranks for f in found] == [[2]], [f.summary for f in found]
    silence = next(e for e in found[0].evidence if e.metric == "seconds_without_progress")
    assert silence.baseline < silence.observed <= silence.baseline + 0.05


def test_a_trackers_due_time_is_when_its_silence_passes_the_threshold() -> None:
    analyzer = streaming.StreamingAnalyzer()
    analyzer.observe(_history())
    due = analyzer.due_s()
    threshold = config.HangConfig().min_s  # 0.25 s steps: the floor decides
    assert due is not None and LAST_END + threshold < due <= LAST_END + threshold + 0.02
    analyzer.observe([_beat(rank, LAST_END + 2.0, waiting=rank != 2) for rank in range(RANKS)])
    assert [f.subjects.ranks for f in analyzer.tick(due)] == [[2]]
    assert analyzer.due_s() is None  # the hang is open: nothing more to find
