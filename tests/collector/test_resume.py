"""A collector that restarts picks running jobs up from its store: stragglers and hangs still
come, though the job never resends its Job record and a hung job sends only heartbeats."""

from __future__ import annotations

from pathlib import Path

from tests.support import simulator as sim
from vigil import codec, schema
from vigil.analyzer import StreamingAnalyzer
from vigil.collector import Store, StoreConfig, history

RANKS, STEPS = 16, 60


def _store(tmp_path: Path) -> Store:
    store = Store(StoreConfig(url=f"sqlite:///{tmp_path / 'c.sqlite3'}"))
    store.migrate()
    return store


def _ingest(store: Store, records: list[schema.Record]) -> None:
    store.ingest(codec.decode_batch(codec.encode_batch(records)))


def _scenario(faults: tuple[sim.Fault, ...]) -> list[list[schema.Record]]:
    config = sim.ScenarioConfig(
        job_id="resume", num_ranks=RANKS, num_steps=STEPS, faults=faults, seed=3
    )
    return list(sim.simulate(config).records())


def test_a_restarted_analyzer_finds_the_straggler_from_the_store(tmp_path: Path) -> None:
    store = _store(tmp_path)
    fault = sim.Fault(kind=sim.FaultKind.STRAGGLER, ranks=(5,), factor=1.5, start_step=10)
    batches = _scenario((fault,))
    half = len(batches) // 2
    for batch in batches[:half]:  # the first collector stored these, then died
        _ingest(store, batch)
    resumed = StreamingAnalyzer()
    resumed.use_history(lambda job, steps: history.recent(store, job, steps))
    found = []
    for batch in batches[half:]:
        # Only step records and aggregates travel after the restart: no Job, no RankInfo.
        later = [r for r in batch if not isinstance(r, schema.Job | schema.RankInfo)]
        _ingest(store, later)
        found.extend(resumed.observe(later))
    stragglers = [f for f in found if f.kind == "straggler"]
    assert stragglers and stragglers[0].subjects.ranks == [5]
    window = resumed._jobs["resume"].window
    assert window.expected == RANKS  # the world size came from the store


def test_a_restarted_analyzer_declares_a_hang_from_heartbeats_alone(tmp_path: Path) -> None:
    store = _store(tmp_path)
    batches = _scenario(())
    for batch in batches:
        _ingest(store, batch)
    ends = [r.end_s for b in batches for r in b if isinstance(r, schema.StepRecord)]
    last_end = max(ends)
    resumed = StreamingAnalyzer()
    resumed.use_history(lambda job, steps: history.recent(store, job, steps))
    hangs = []
    for t in range(1, 120):  # the job hung at its last step; beats keep coming each second
        now = last_end + t
        # Rank 3 never entered the next all-reduce the others wait in: the hang's culprit
        # (a stall that positions cannot name anyone for waits several thresholds).
        beats: list[schema.Record] = [
            schema.Heartbeat(
                job_id="resume",
                rank=r,
                time_s=now,
                last_step=STEPS - 1,
                last_group="dp",
                last_seq=STEPS if r == 3 else STEPS + 1,
                last_op="all_reduce",
                state=schema.RankState.COMPUTE if r == 3 else schema.RankState.IN_COLLECTIVE,
            )
            for r in range(RANKS)
        ]
        hangs.extend(f for f in resumed.observe(beats) if f.kind == "hang")
        hangs.extend(f for f in resumed.tick(now) if f.kind == "hang")
        if hangs:
            break
    assert hangs, "no hang after two minutes of heartbeats without progress"
    assert hangs[0].subjects.ranks == [3]
    step_time = (
        last_end - min(r.start_s for b in batches for r in b if isinstance(r, schema.StepRecord))
    ) / STEPS
    assert hangs[0].detected_s - last_end <= max(3 * step_time, 5.0) + 1.0


def test_idle_jobs_are_forgotten_and_jobs_are_bounded() -> None:
    from vigil.analyzer import config as config_mod

    cfg = config_mod.AnalyzerConfig(stream_job_idle_s=60.0, stream_max_jobs=50)
    analyzer = StreamingAnalyzer(cfg)
    analyzer.tick(1000.0)
    for i in range(200):
        analyzer.observe([schema.Heartbeat(job_id=f"j{i}", rank=0, time_s=1000.0)])
    assert len(analyzer.job_ids()) == 50 and analyzer.forgotten == 150
    analyzer.tick(1030.0)
    analyzer.observe([schema.Heartbeat(job_id="j199", rank=0, time_s=1030.0)])
    analyzer.tick(1070.0)
    assert analyzer.job_ids() == ["j199"]  # the others sent nothing for 70 s
