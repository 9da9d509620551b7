"""A long pause nobody can be named for must not become a hang as it ends.

data/jsonl_pause_ends/gpt-pauses is the SDK's own JSONL of a real 4-rank gloo job: a user's GPT
script (tests/realjobs/gpt_job.py, compiled, DDP) whose rank 0 saves for 6 s between steps 25
and 26 without a checkpoint span, while ranks 1-3 wait in step 26's gradient all-reduce, a wait
DDP's C++ hides from the SDK. The silence passes the 3.5 s threshold with no culprit to name
(no rank says it waits, every rank is at the same sequence number), which is a hang only after
five thresholds. As the save ends, rank 2's heartbeat shows it in the next all-reduce (#54)
0.03 s before the step ends, while its peers' newest heartbeats, sent a second earlier, still
show #53: read as positions, ranks 0, 1 and 3 "never entered" what rank 2 waits in. They had
not yet reported since rank 2 was seen there; the hang must wait for their next heartbeats.
"""

from __future__ import annotations

from tests.analyzer import recorded
from vigil import schema
from vigil.analyzer import config, engine, streaming

PAUSED = recorded.DATA / "jsonl_pause_ends" / "gpt-pauses"


def test_the_recorded_save_is_no_hang_offline_or_online() -> None:
    records = recorded.records(PAUSED)
    cfg = config.AnalyzerConfig()
    assert recorded.named(engine.analyze_records(records, cfg)) == []
    assert recorded.named(recorded.streamed_in_time(records, cfg)) == []


JOB = "pause-ends"
RANKS = 4
STEP_S = 0.25
PAUSED_AT = 16  # rank 0 pauses between steps 15 and 16; the others wait in step 16
T0 = 1_000.0
LAST_END = T0 + PAUSED_AT * STEP_S


def _history() -> list[schema.Record]:
    records: list[schema.Record] = [schema.Job(job_id=JOB, world_size=RANKS)]
    for step in range(PAUSED_AT):
        for rank in range(RANKS):
            start = T0 + step * STEP_S
            records += [
                schema.StepRecord(
                    job_id=JOB, rank=rank, step=step, start_s=start, end_s=start + STEP_S
                ),
                schema.CollectiveAggregate(
                    job_id=JOB, rank=rank, step=step, group="world", op="all_reduce", count=1,
                    last_seq=step,
                ),
            ]  # fmt: skip
    return records


def _beat(rank: int, time_s: float, seq: int = PAUSED_AT - 1) -> schema.Heartbeat:
    """Rank 0 between steps in its own code; the others in step 16, or waiting in #`seq`."""
    waiting = seq >= PAUSED_AT
    return schema.Heartbeat(
        job_id=JOB, rank=rank, time_s=time_s, last_step=PAUSED_AT - 1, last_group="world",
        last_seq=seq, last_op="all_reduce",
        state=schema.RankState.IN_COLLECTIVE if waiting else schema.RankState.COMPUTE,
        between_steps=rank == 0,
    )  # fmt: skip


def _pause(seen_waiting_at: float, pause_s: float) -> list[schema.Finding]:
    """Each rank beats once a second (rank r at +0.01 r s); rank 2 is seen in all-reduce #16
    from `seen_waiting_at` (seconds after the last step ended) on; at `pause_s` every rank
    ends step 16. Returns the hang findings raised, ticking every 0.05 s."""
    analyzer = streaming.StreamingAnalyzer()
    found = list(analyzer.observe(_history()))
    beats = sorted(
        (LAST_END + k + 0.01 * rank + 0.2, rank)
        for k in range(int(pause_s) + 1)
        for rank in range(4)
    )
    beats.append((LAST_END + seen_waiting_at, 2))
    t = LAST_END
    while t < LAST_END + pause_s:
        t += 0.05
        due = [b for b in beats if b[0] <= t]
        beats = [b for b in beats if b[0] > t]
        sent = [
            _beat(
                r, at, PAUSED_AT if r == 2 and at >= LAST_END + seen_waiting_at else PAUSED_AT - 1
            )
            for at, r in due
        ]
        found += [*analyzer.observe(sent), *analyzer.tick(t)]
    end = LAST_END + pause_s
    ends = [
        schema.StepRecord(job_id=JOB, rank=r, step=PAUSED_AT, start_s=LAST_END, end_s=end)
        for r in range(RANKS)
    ]
    found += [*analyzer.observe(ends), *analyzer.tick(end + 1.0)]
    return [f for f in found if f.kind is schema.FindingKind.HANG]


def test_a_peer_seen_in_the_next_collective_as_a_pause_ends_names_no_one() -> None:
    """Rank 2 is seen in #16 0.05 s before the 6.3 s pause ends; its peers last reported 0.9 s
    before that: no hang (it named ranks 0, 1 and 3 before their heartbeats had to be newer)."""
    assert _pause(seen_waiting_at=6.25, pause_s=6.3) == []


def test_a_peer_waiting_since_the_stall_began_names_the_others_at_the_threshold() -> None:
    """The same job, but rank 2 has waited in #16 since the stall began and ranks 0, 1 and 3
    keep reporting from #15: they are behind, and named once the threshold has passed."""
    found = _pause(seen_waiting_at=0.1, pause_s=8.0)
    assert found and found[0].subjects.ranks == [0, 1, 3], [f.summary for f in found]
    assert found[0].confidence == 0.95
    silence = next(e for e in found[0].evidence if e.metric == "seconds_without_progress")
    assert silence.observed <= silence.baseline + 0.5


def test_a_peer_seen_there_late_in_a_stall_still_names_the_others_after_their_next_beats() -> None:
    """Rank 2 is first seen in #16 5 s into the stall and the others keep reporting from #15:
    once their next heartbeats show them behind it, they are named, with full confidence."""
    found = _pause(seen_waiting_at=5.0, pause_s=9.0)
    assert found and found[0].subjects.ranks == [0, 1, 3], [f.summary for f in found]
    assert found[0].confidence == 0.95
    silence = next(e for e in found[0].evidence if e.metric == "seconds_without_progress")
    assert 5.0 < silence.observed <= 6.5
