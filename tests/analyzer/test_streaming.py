"""The streaming hook: per-job rolling state, agreement with offline analysis, resolution."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import observed as ob
from tests.support import simulator as sim
from vigil import columns, schema
from vigil.analyzer import arrays, engine, jobstream, stragglers, streaming

STRAGGLER = sim.Fault(kind=sim.FaultKind.STRAGGLER, ranks=(21,), factor=1.25, start_step=20)


def _sim(*faults: sim.Fault, job: str = "sim", steps: int = 60) -> sim.Simulation:
    return sim.simulate(
        sim.ScenarioConfig(job_id=job, num_ranks=32, num_steps=steps, faults=faults, seed=6)
    )


def _feed(
    analyzer: streaming.StreamingAnalyzer, batches: Iterator[list[schema.Record]]
) -> list[schema.Finding]:
    out: list[schema.Finding] = []
    for batch in batches:
        out.extend(analyzer.observe(batch))
    return out


def test_streaming_and_offline_agree_on_a_straggler() -> None:
    s = _sim(STRAGGLER)
    streamed = [
        f for f in _feed(streaming.StreamingAnalyzer(), s.records()) if f.kind == "straggler"
    ]
    offline = [f for f in engine.analyze_arrays(s.arrays) if f.kind == "straggler"]
    assert [f.subjects.ranks for f in streamed] == [f.subjects.ranks for f in offline] == [[21]]
    assert streamed[0].subjects.devices == ["GPU-00000021"]  # from RankInfo.device_uuid
    assert streamed[0].step_start == offline[0].step_start
    assert streamed[0].finding_id == offline[0].finding_id  # the collector upserts one finding


def test_finding_resolves_with_the_same_id_when_the_rank_recovers() -> None:
    recover = sim.Fault(kind=sim.FaultKind.STRAGGLER, ranks=(21,), factor=1 / 1.25, start_step=40)
    found = [
        f
        for f in _feed(streaming.StreamingAnalyzer(), _sim(STRAGGLER, recover).records())
        if f.kind == "straggler"
    ]
    assert [f.state for f in found] == ["open", "resolved"]
    assert found[0].finding_id == found[1].finding_id
    # The rank recovered at step 40; its smoothed signal (the mean of its last smooth_steps
    # steps) stays up for about half of them.
    smooth = streaming.config_mod.StragglerConfig().smooth_steps
    assert 39 <= found[1].step_end <= 40 + smooth // 2 + 1


def test_a_silent_rank_does_not_stall_analysis_of_the_others() -> None:
    s = _sim(STRAGGLER)
    analyzer = streaming.StreamingAnalyzer()

    def without_rank_0() -> Iterator[list[schema.Record]]:
        for batch in s.records():
            yield [
                r for r in batch if getattr(r, "rank", -1) != 0 or isinstance(r, schema.RankInfo)
            ]

    found = [f for f in _feed(analyzer, without_rank_0()) if f.kind == "straggler"]
    assert [f.subjects.ranks for f in found] == [[21]]


def test_jobs_are_kept_apart_in_mixed_batches() -> None:
    a, b = _sim(STRAGGLER, job="job-a"), _sim(job="job-b")
    analyzer = streaming.StreamingAnalyzer()
    found = []
    for batch_a, batch_b in zip(a.records(), b.records(), strict=True):
        found.extend(analyzer.observe([*batch_a, *batch_b]))
    assert analyzer.job_ids() == ["job-a", "job-b"]
    assert {f.job_id for f in found} == {"job-a"}
    assert [f.subjects.ranks for f in found if f.kind == "straggler"] == [[21]]


def test_findings_and_actions_in_a_batch_are_ignored() -> None:
    analyzer = streaming.StreamingAnalyzer()
    finding = schema.Finding(finding_id="x", kind=schema.FindingKind.HANG, job_id="j")
    action = schema.Action(action_id="a", kind=schema.ActionKind.RESTART, job_id="j")
    assert analyzer.observe([finding, action]) == []
    assert analyzer.job_ids() == []


def test_late_records_for_analysed_steps_are_dropped_quietly() -> None:
    s = _sim(steps=40)
    analyzer = streaming.StreamingAnalyzer()
    batches = list(s.records())
    _feed(analyzer, iter(batches))
    assert analyzer.observe(batches[1]) == []  # step 0 again, long after it was analysed


def test_per_rank_shipments_of_several_steps_are_analysed_like_the_whole_job() -> None:
    """Each SDK ships its own rank: a batch holds one rank's records for 10 steps."""
    s = _sim(STRAGGLER)
    batches = list(s.records())
    info, steps = (
        batches[0],
        [r for b in batches[1:] for r in b if isinstance(r, schema.StepRecord)],
    )
    analyzer = streaming.StreamingAnalyzer()
    found = list(analyzer.observe(info))
    for first in range(0, 60, 10):
        for rank in range(32):
            shipment = [r for r in steps if r.rank == rank and first <= r.step < first + 10]
            found.extend(analyzer.observe(shipment))
    offline = [f for f in engine.analyze_arrays(s.arrays) if f.kind == "straggler"]
    streamed = [f for f in found if f.kind == "straggler"]
    assert [f.finding_id for f in streamed] == [f.finding_id for f in offline]


def test_whole_batches_of_steps_find_what_step_by_step_feeding_finds() -> None:
    """Ready steps are scored together; the findings must be those of one step at a time,
    also with the step columns handed over as the collector does."""
    recover = sim.Fault(kind=sim.FaultKind.STRAGGLER, ranks=(21,), factor=1 / 1.25, start_step=40)
    drop = sim.Fault(kind=sim.FaultKind.THROTTLE, ranks=(), factor=0.7, start_step=45)
    s = _sim(STRAGGLER, recover, drop, steps=80)
    batches = list(s.records())
    info = batches[0]
    steps = [r for b in batches[1:] for r in b if isinstance(r, schema.StepRecord)]

    def findings(chunk: int, with_columns: bool) -> list[tuple[str, str, int, int]]:
        analyzer = streaming.StreamingAnalyzer()
        out = list(analyzer.observe(info))
        for first in range(0, 80, chunk):
            batch = [r for r in steps if first <= r.step < first + chunk]
            cols = columns.from_records(batch) if with_columns else None
            out.extend(analyzer.observe(batch, cols))
        return [(f.kind, f.state, f.step_start, f.step_end) for f in out]

    one_by_one = findings(1, with_columns=False)
    assert {k for k, *_ in one_by_one} >= {"straggler", "mfu_drop"}
    assert findings(8, with_columns=True) == one_by_one
    assert findings(16, with_columns=False) == one_by_one


def test_a_jump_in_step_numbers_costs_no_more_than_a_step() -> None:
    """A step counter that jumps (a bug, or Unix seconds as steps) must not make the analyzer
    walk the steps in between: each batch's work is bounded by the window, not the gap."""
    import time

    analyzer = streaming.StreamingAnalyzer()
    job = [schema.Job(job_id="jump", world_size=2)]
    analyzer.observe(job)

    def step(rank: int, number: int) -> schema.StepRecord:
        return schema.StepRecord(
            job_id="jump", rank=rank, step=number, start_s=1.0, end_s=1.5, tokens=10
        )

    started = time.perf_counter()
    for number in (0, 1, 2**52, 2**52 + 1, 2**52 + 2, 2**52 + 3, 1_700_000_000, 2**62):
        analyzer.observe([step(0, number), step(1, number)])
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"eight batches took {elapsed:.1f} s"
    stream = analyzer._jobs["jump"]
    assert stream.num_analysed >= 4  # the steps after the jump were analysed, not skipped


def test_a_declared_world_size_allocates_nothing_until_ranks_report() -> None:
    analyzer = streaming.StreamingAnalyzer()
    analyzer.observe([schema.Job(job_id="big", world_size=131_072)])
    window = analyzer._jobs["big"].window
    assert window.num_ranks == 0 and window.expected == 131_072
    analyzer.observe(
        [schema.StepRecord(job_id="big", rank=131_071, step=0, start_s=1.0, end_s=2.0)]
    )
    assert window.num_ranks == 1
    assert sum(v.nbytes for v in window._data.values()) < 1 << 20
    assert window.quorum_step() == -1  # the other 131,071 declared ranks have not reported


def _stream_observed(job: ob.Job, kind: str) -> list[tuple[schema.Finding, int]]:
    """Feed a job as a collector receives it (its identity, then each flusher shipment): its
    findings of `kind`, each with the newest step shipped when it came."""
    analyzer = streaming.StreamingAnalyzer()
    found = [(f, -1) for f in analyzer.observe(job.records)]
    for _time_s, batch in sorted(job.shipped, key=lambda shipment: shipment[0]):
        newest = max(r.step for r in batch if isinstance(r, schema.StepRecord))
        found += [(f, newest) for f in analyzer.observe(batch)]
    return [(f, newest) for f, newest in found if f.kind == kind]


def test_a_persistent_rank_first_rejected_is_reported_when_its_evidence_shows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 2x every 4th step: when rank 5 first becomes persistent, the median of its compute over
    # the episode so far is not yet up (3 of 4 of its steps are normal), so that detection
    # reports nothing; the retries find it once the episode's evidence shows it.
    fault = ob.Fault(
        kind=ob.FaultKind.STRAGGLER, rank=5, start_step=14, factor=2.0,
        position=ob.Position.BEFORE, every=4,
    )  # fmt: skip
    job = ob.run(ob.JobConfig(job_id="intermittent", dp=16, num_steps=44, faults=(fault,), seed=4))
    found = [f for f, _newest in _stream_observed(job, "straggler")]
    # one finding, re-sent under its id as its count of slow steps grows (`_says_more`)
    assert {f.finding_id for f in found} == {found[0].finding_id}
    assert found[0].subjects.ranks == [5] and found[0].state == "open"
    monkeypatch.setattr(jobstream.JobStream, "retry_every", lambda _self: 10**9)  # no retries
    assert _stream_observed(job, "straggler") == []


def test_an_episode_whose_hits_dipped_is_still_retried_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 1F1B pipeline (pp 4 x dp 8) whose rank 1 is 2x slow in its optimizer step every 4th
    step from step 12: its smoothed flags reach persistence (8 of 12) at step ~24, lapse after
    step 27 and dip to 7 at step 32 while the episode goes on; its finding passes its checks
    only once its slow steps show a period. Its 6th slow step on the period, step 28, falls
    after its last flagged step while it is still persistent: the evidence counts there
    (`stragglers._held_until`), and the finding goes out as step 28 comes in, 16 steps after
    onset. Searched only up to its last flagged step, the evidence showed once a later flag
    extended the episode (21 steps after onset); and the streaming analyzer, which then
    retried only while the rank was persistent at that moment, missed it."""
    fault = ob.Fault(
        kind=ob.FaultKind.STRAGGLER, rank=1, start_step=12, factor=2.0,
        position=ob.Position.OPTIMIZER, every=4,
    )  # fmt: skip
    job = ob.run(
        ob.JobConfig(
            job_id="dipped", tp=1, dp=8, pp=4, ranks_per_node=8, ddp=False, layers=2,
            buckets=4, microbatches=4, num_steps=37, compute_s=1.0069, data_s=0.034,
            dp_transfer_s=0.08, p2p_transfer_s=0.01, jitter=0.0221, hiccup_rate=0.0035,
            load_bursts=1, heartbeat_loss=0.108, faults=(fault,), seed=3026,
        )
    )  # fmt: skip
    offline = engine.analyze_arrays(arrays.from_records(job.all_records(), job_id="dipped"))
    assert [(f.kind, f.subjects.ranks) for f in offline] == [("straggler", [1])]
    found = _stream_observed(job, "straggler")
    assert found and {tuple(f.subjects.ranks) for f, _ in found} == {(1,)}, found
    assert "intermittent" in found[-1][0].summary, found[-1][0].summary
    first_sent = found[0][1]
    assert first_sent - 12 <= 20, first_sent  # within 20 steps of onset
    # Its evidence searched only up to its last flagged step, the retries until the episode
    # ends find it, later ...
    monkeypatch.setattr(stragglers, "_held_until", lambda _hits, last, _min_hits: last)
    later = _stream_observed(job, "straggler")
    assert later and later[0][1] - 12 > 20, later
    # ... and retrying only while persistent at that moment, as before, misses it.
    monkeypatch.setattr(
        jobstream.JobStream,
        "_unreported",
        lambda self: any(
            (self.hits[k] >= self.cfg.straggler.min_hits).any()
            and not any(key[0] is k for key in self.open)
            for k in stragglers.RANK_KINDS
        ),
    )
    assert _stream_observed(job, "straggler") == []


def _first_slow_link(job: ob.Job) -> tuple[list[int], int] | None:
    """The first slow-link finding streamed, and the newest step shipped when it came."""
    found = _stream_observed(job, "slow_link")
    return (found[0][0].subjects.ranks, found[0][1]) if found else None


def test_a_small_job_s_links_are_judged_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 3's NIC moves bytes 2.5x slower from step 14: its dp group is flagged from then on,
    # and persistent (8 of 12 steps) at step 21; judged every step, the finding comes then.
    fault = ob.Fault(kind=ob.FaultKind.SLOW_LINK, rank=3, start_step=14, factor=2.5)
    job = ob.run(
        ob.JobConfig(
            job_id="link", tp=2, dp=4, ddp=False, ranks_per_node=2, num_steps=40,
            faults=(fault,), seed=1,
        )
    )  # fmt: skip
    min_hits = streaming.config_mod.StragglerConfig().min_hits
    assert _first_slow_link(job) == ([1, 3, 5, 7], 14 + min_hits - 1)
    window = streaming.config_mod.StragglerConfig().window
    monkeypatch.setattr(jobstream.JobStream, "judge_every", lambda _self: window)
    found = _first_slow_link(job)
    assert found is not None and found[1] > 14 + min_hits  # once a window: later


def test_large_jobs_judge_links_less_often_as_it_costs_more() -> None:
    cfg = streaming.config_mod.AnalyzerConfig()
    every = {}
    for ranks in (8, 256, 257, 1024, 10_000):
        stream = jobstream.JobStream("big", cfg)
        for rank in range(ranks):  # each rank reported
            stream.window.column(rank)
        every[ranks] = stream.judge_every()
    assert every == {8: 1, 256: 1, 257: 2, 1024: 4, 10_000: cfg.straggler.window}
