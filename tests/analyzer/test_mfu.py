"""MFU drops: change points on noisy series, and attribution to their cause."""

from __future__ import annotations

import numpy as np
import pytest

from tests.analyzer import recorded
from tests.support import observed as ob
from tests.support import simulator as sim
from vigil import flops, schema
from vigil.analyzer import arrays, config, engine, findings, jobstream, mfu, streaming

Kind = schema.FindingKind


def _drops(*faults: sim.Fault, ranks: int = 64) -> list[schema.Finding]:
    s = sim.simulate(sim.ScenarioConfig(num_ranks=ranks, num_steps=120, faults=faults, seed=9))
    return [f for f in engine.analyze_arrays(s.arrays) if f.kind == "mfu_drop"]


def test_change_point_ignores_isolated_slow_steps() -> None:
    rng = np.random.default_rng(0)
    series = 0.45 * rng.lognormal(0, 0.01, 200)
    series[50] = series[70] = 0.2  # two hiccups before the real change
    series[120:] *= 0.8
    [drop] = mfu.find_drops(series, config.MfuConfig())
    assert drop.change_row == 120
    # The levels the series was built with: 0.45 (lognormal median), then 0.8 x 0.45 = 0.36.
    assert drop.before == pytest.approx(0.45, rel=0.01)
    assert drop.after == pytest.approx(0.36, rel=0.01)


def test_no_drop_on_steady_noise() -> None:
    rng = np.random.default_rng(1)
    assert mfu.find_drops(0.4 * rng.lognormal(0, 0.03, 5000), config.MfuConfig()) == []


def test_job_wide_data_stall_is_attributed_to_data_loading() -> None:
    [drop] = _drops(sim.Fault(kind=sim.FaultKind.DATA_STALL, extra_s=0.3, start_step=60))
    assert "data stall" in drop.summary and drop.step_start == 60
    data = next(e for e in drop.evidence if e.metric == "data_time")
    assert data.observed - data.baseline > 0.25


def test_one_ranks_data_stall_names_the_rank_and_is_the_data_stall_findings_evidence() -> None:
    """One rank's loader takes 0.5 s more a step: the job waits for it (its median data time
    does not move, its max does), so the drop names that rank, and the data-stall finding that
    names it too carries the drop instead of a second finding."""
    stall = sim.Fault(kind=sim.FaultKind.DATA_STALL, ranks=(9,), extra_s=0.5, start_step=60)
    s = sim.simulate(sim.ScenarioConfig(num_ranks=64, num_steps=120, seed=9, faults=(stall,)))
    [drop] = mfu.detect(s.arrays, config.MfuConfig())
    assert drop.summary.endswith(": data stall (rank 9)") and drop.subjects.ranks == [9]
    worst = next(e for e in drop.evidence if e.metric == "max_data_time")
    assert (worst.observed or 0) - (worst.baseline or 0) > 0.4
    found = engine.analyze_arrays(s.arrays)
    assert [(f.kind, f.subjects.ranks) for f in found] == [(schema.FindingKind.DATA_STALL, [9])]
    assert any(e.metric == drop.evidence[0].metric for e in found[0].evidence)


def test_slow_link_drop_is_attributed_to_communication() -> None:
    [drop] = _drops(
        sim.Fault(kind=sim.FaultKind.SLOW_LINK, nodes=(1, 2), factor=3.0, start_step=60)
    )
    assert "communication" in drop.summary


def test_throttling_everywhere_is_attributed_to_throttling() -> None:
    [drop] = _drops(sim.Fault(kind=sim.FaultKind.THROTTLE, factor=0.8, start_step=60), ranks=16)
    assert "GPU throttling" in drop.summary and len(drop.subjects.ranks) == 16
    level = drop.evidence[0]
    assert level.metric == "mfu" and level.observed < 0.85 * (level.baseline or 0)


# A job whose SDK sent model FLOPs but no MFU (no peak known on the ranks); the Job record
# declares the peak, so the analyzer derives MFU. Every figure below is worked out by hand:
SHAPE = schema.ModelShape(params=1_000_000, layers=4, hidden=256, heads=4, seq_len=512)
# 6 N + 12 L hidden T = 6,000,000 + 12 x 4 x 256 x 512 = 6,000,000 + 6,291,456
FLOPS_PER_TOKEN = 12_291_456
TOKENS = 4 * 512  # four sequences per rank and step
MODEL_FLOPS = 25_172_901_888  # 12,291,456 x 2,048 per rank and step
PEAK = 2e11  # FLOP/s per device
STEP_S, SLOW_STEP_S = 0.25, 0.3125  # from step 60 every step takes 25 % longer
MFU_BEFORE = 0.50345803776  # 25,172,901,888 / 0.25 s / 2e11
MFU_AFTER = 0.402766430208  # 25,172,901,888 / 0.3125 s / 2e11 (= 0.8 x MFU_BEFORE)


def _job_without_sdk_mfu(num_ranks: int = 4, num_steps: int = 100) -> list[schema.Record]:
    job = schema.Job(job_id="flops", world_size=num_ranks, model=SHAPE, peak_flops=PEAK)
    records: list[schema.Record] = [job]
    start = 1_800_000_000.0
    for step in range(num_steps):
        seconds = STEP_S if step < 60 else SLOW_STEP_S
        records += [
            schema.StepRecord(
                job_id="flops",
                rank=rank,
                step=step,
                start_s=start,
                end_s=start + seconds,
                forward_s=seconds / 3,
                backward_s=seconds / 2,
                tokens=TOKENS,
                model_flops=MODEL_FLOPS,
            )
            for rank in range(num_ranks)
        ]
        start += seconds
    return records


def test_hand_computed_flops_of_a_small_model() -> None:
    assert flops.flops_per_token(SHAPE) == FLOPS_PER_TOKEN
    assert flops.flops_per_token(SHAPE) * TOKENS == MODEL_FLOPS


def test_mfu_from_model_flops_step_time_and_peak_matches_the_hand_computed_figure() -> None:
    a = arrays.from_records(_job_without_sdk_mfu(), job_id="flops")
    job_mfu = a.job_mfu()
    assert job_mfu[:60] == pytest.approx(np.full(60, MFU_BEFORE), rel=1e-6)
    assert job_mfu[60:] == pytest.approx(np.full(40, MFU_AFTER), rel=1e-6)


def _drop_levels(found: list[schema.Finding]) -> tuple[int, float, float | None]:
    [drop] = [f for f in found if f.kind == schema.FindingKind.MFU_DROP]
    level = drop.evidence[0]
    assert level.metric == "mfu" and "dropped 20.0%" in drop.summary, drop.summary
    return drop.step_start, level.observed, level.baseline


@pytest.mark.parametrize("mode", ["offline", "streaming"])
def test_mfu_drop_reports_the_hand_computed_levels(mode: str) -> None:
    records = _job_without_sdk_mfu()
    if mode == "offline":
        found = engine.analyze_records(records)
    else:
        analyzer = streaming.StreamingAnalyzer()
        found = [f for r in records for f in analyzer.observe([r])]
    step, observed, baseline = _drop_levels(found)
    assert step == 60
    # Evidence carries six significant digits.
    assert observed == pytest.approx(MFU_AFTER, rel=1e-5)
    assert baseline == pytest.approx(MFU_BEFORE, rel=1e-5)


# Recorded-style records of 8 ranks: each step every rank computes (forward + backward) for a
# time proportional to its tokens, and the ranks that finish first wait for the last one in the
# gradient all-reduce (comm_wait_s). From step 60 rank 2 either gets twice the tokens (a longer
# sequence share: 2x compute, for its 2x work) or computes 1.6x slower on the same tokens.
RANKS, HEAVY = 8, 2
PER_TOKEN_S = 0.2 / TOKENS  # 0.2 s of compute for the usual 2,048 tokens


def _imbalanced_job(fault: str) -> list[schema.Record]:
    rng = np.random.default_rng(5)
    job = schema.Job(job_id="imb", world_size=RANKS, model=SHAPE, peak_flops=PEAK)
    records: list[schema.Record] = [job]
    start = 1_800_000_000.0
    for step in range(100):
        tokens = np.full(RANKS, TOKENS)
        slowness = np.ones(RANKS)
        if step >= 60 and fault == "tokens":
            tokens[HEAVY] = 2 * TOKENS
        if step >= 60 and fault == "slow":
            slowness[HEAVY] = 1.6
        compute = tokens * PER_TOKEN_S * slowness * rng.lognormal(0, 0.01, RANKS)
        seconds = float(compute.max()) + 0.05  # everyone waits for the last, then transfers
        records += [
            schema.StepRecord(
                job_id="imb",
                rank=rank,
                step=step,
                start_s=start,
                end_s=start + seconds,
                forward_s=float(compute[rank]) / 3,
                backward_s=float(compute[rank]) * 2 / 3,
                comm_wait_s=seconds - float(compute[rank]),  # blocked in the all-reduce
                tokens=int(tokens[rank]),
                model_flops=float(tokens[rank]) * FLOPS_PER_TOKEN,
            )
            for rank in range(RANKS)
        ]
        start += seconds
    return records


def test_a_token_heavy_rank_is_not_blamed_as_a_straggler_for_an_mfu_drop() -> None:
    found = engine.analyze_records(_imbalanced_job("tokens"))
    [drop] = [f for f in found if f.kind == schema.FindingKind.MFU_DROP]
    assert drop.step_start == 60
    assert "straggler" not in drop.summary, drop.summary
    assert "sequence-length imbalance" in drop.summary and f"rank {HEAVY} has 2x" in drop.summary
    assert drop.subjects.ranks == []  # the job's finding: no rank is at fault
    weighed = next(e for e in drop.evidence if e.metric == "max_token_weighed_compute_time")
    assert weighed.observed == pytest.approx(weighed.baseline, rel=0.05)  # per token: unchanged
    raw = next(e for e in drop.evidence if e.metric == "max_compute_time")
    assert raw.observed == pytest.approx(2 * (raw.baseline or 0), rel=0.05)
    busiest = next(e for e in drop.evidence if e.metric == "max_tokens")
    assert (busiest.observed, busiest.baseline) == (2 * TOKENS, TOKENS)
    # The straggler detector agrees: nobody straggles.
    assert not [f for f in found if f.kind == schema.FindingKind.STRAGGLER]


def test_a_genuinely_slow_rank_is_still_the_straggler_of_an_mfu_drop() -> None:
    records = _imbalanced_job("slow")
    [drop] = mfu.detect(arrays.from_records(records), config.MfuConfig())
    assert drop.step_start == 60
    assert f"a straggler (rank {HEAVY})" in drop.summary, drop.summary
    assert drop.subjects.ranks == [HEAVY]
    level = drop.evidence[0]
    # MFU before: 2,048 x 12,291,456 / (0.2 + 0.05 s) / 2e11; after: / (0.32 + 0.05 s).
    assert level.baseline == pytest.approx(MFU_BEFORE, rel=0.03)
    assert level.observed == pytest.approx(MFU_BEFORE * 0.25 / 0.37, rel=0.03)
    # The straggler detector names the same rank: the drop is its evidence, not a 2nd finding.
    found = engine.analyze_records(records)
    assert [(f.kind, f.subjects.ranks) for f in found] == [(schema.FindingKind.STRAGGLER, [HEAVY])]
    folded = next(e for e in found[0].evidence if e.metric == level.metric)
    assert (folded.observed, folded.baseline) == (level.observed, level.baseline)


def test_the_rank_named_for_a_drop_holds_the_steps_up_most() -> None:
    """8 steps of 8 ranks: rank 3 computes 2x every 4th step (its median is normal), rank 5
    is 2 % slower throughout and has one 1.6x hiccup. Rank 3 held the job up by 2 x 1.0 s,
    rank 5 by 0.6 s and 8 x 0.02 s; a ramp's rank (4 % more each step) by 8 x 0.18 s on average."""
    rng = np.random.default_rng(0)
    compute = 1.0 + rng.uniform(-0.01, 0.01, (8, 8))
    compute[:, 5] += 0.02
    compute[[1, 5], 3] = 2.0
    compute[2, 5] = 1.6
    assert int(np.argmax(np.median(compute, axis=0))) == 5  # the median names the hiccup's
    assert mfu.holds_up_most(compute) == 3
    compute[:, 3] = np.nan  # a rank that sent nothing is not named
    assert mfu.holds_up_most(compute) == 5
    compute[:, 6] += 0.04 * np.arange(1, 9)  # 0.04 to 0.32 s: the slowest at its last steps only
    assert mfu.holds_up_most(compute) == 6


def test_token_weighing_leaves_compute_alone_without_varying_tokens() -> None:
    compute = np.array([[0.2, 0.4], [0.2, 0.2]], dtype=np.float32)
    same = np.full((2, 2), 8.0, dtype=np.float32)
    assert mfu.token_weighed(compute, same) is compute
    assert mfu.token_weighed(compute, np.zeros((2, 2), dtype=np.float32)) is compute
    tokens = np.array([[8.0, 16.0], [8.0, 0.0]], dtype=np.float32)
    weighed = mfu.token_weighed(compute, tokens)
    # Row 0: median tokens 12; 0.2 x 12/8 and 0.4 x 12/16 (the same per token). Row 1: rank 1
    # reported no tokens and keeps its raw compute.
    assert weighed.ravel().tolist() == pytest.approx([0.3, 0.3, 0.2, 0.2])


def test_streaming_folds_the_drop_into_the_straggler_it_names() -> None:
    records = _imbalanced_job("slow")
    analyzer = streaming.StreamingAnalyzer()
    out: list[schema.Finding] = []
    for step in range(100):  # a collector's batches: one step of every rank at a time
        out.extend(analyzer.observe([r for r in records if getattr(r, "step", 0) == step]))
    assert {f.kind for f in out} == {schema.FindingKind.STRAGGLER}, [f.summary for f in out]
    newest = out[-1]  # re-sent under its id with the drop's evidence
    assert newest.finding_id == out[0].finding_id and newest.subjects.ranks == [HEAVY]
    assert any(e.metric == "mfu" and "job mfu from step 60" in e.note for e in newest.evidence)


def _fast_step(rank: int, step: int, rng: np.random.Generator) -> schema.StepRecord:
    start = 1000.0 + 0.02 * step
    took = 0.02 * rng.uniform(0.95, 1.05)
    return schema.StepRecord(
        job_id="fast", rank=rank, step=step, start_s=start, end_s=start + took, tokens=32
    )


def test_steps_analysed_before_every_rank_reported_them_are_no_throughput_drop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job of 20 ms steps whose ranks flush every second: rank 0's batches come in step by
    step, ranks 1-3's 50 steps at a time. With a window that cannot grow past 64 steps (as a
    job of 10,000 ranks' cannot), the streaming analyzer analyses steps before three of four
    ranks reported them. Their throughput is read from the ranks that did (MFU unknown:
    tokens per second), not as a quarter of the job's."""
    monkeypatch.setattr(jobstream, "MAX_WINDOW_STEPS", 64)
    rng = np.random.default_rng(4)
    analyzer = streaming.StreamingAnalyzer()
    job = schema.Job(job_id="fast", name="fast", world_size=4)
    ranks = [schema.RankInfo(job_id="fast", rank=r, node="n0", world_size=4) for r in range(4)]
    out = list(analyzer.observe([job, *ranks]))
    late: list[schema.Record] = []
    for step in range(600):
        late.extend(_fast_step(rank, step, rng) for rank in (1, 2, 3))
        out.extend(analyzer.observe([_fast_step(0, step, rng)]))
        if step % 50 == 49:
            out.extend(analyzer.observe(late))
            late = []
    # It analysed the steps, each at the job's throughput (4 x 32 tokens in ~20 ms), and the
    # steps three ranks had not reported yet were among them.
    series = np.asarray(analyzer._jobs["fast"].mfu_series)
    assert series.size == 64 and np.all(np.abs(series / 6400 - 1) < 0.06), series
    assert out == [], [f.summary for f in out]


def _dipping_job(dip_steps: int) -> list[schema.Record]:
    """4 ranks of 20 ms steps (±2 %) whose steps all take 1.3x longer over `dip_steps` steps
    from step 200 (a job-wide slowdown: every rank computes longer), 600 steps."""
    rng = np.random.default_rng(5)
    out: list[schema.Record] = [schema.Job(job_id="dip", name="dip", world_size=4)]
    t = 1000.0
    for step in range(600):
        took = 0.02 * rng.uniform(0.98, 1.02) * (1.3 if 200 <= step < 200 + dip_steps else 1.0)
        out += [
            schema.StepRecord(
                job_id="dip",
                rank=r,
                step=step,
                start_s=t,
                end_s=t + took,
                backward_s=took,
                tokens=32,
            )
            for r in range(4)
        ]
        t += took
    return out


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_throughput_dip_over_within_seconds_is_no_drop(mode: str) -> None:
    """A dip of 30 steps (~0.8 s) is no drop (`MfuConfig.min_drop_s`, 3 s); the same dip held
    for 300 steps (~8 s) is, reported once it has lasted 3 s, offline and online alike; with
    no minimum duration the short dip was reported too."""

    def drops(records: list[schema.Record], cfg: config.AnalyzerConfig) -> list[schema.Finding]:
        return [f for f in recorded.analyse(mode, records, cfg) if f.kind == "mfu_drop"]

    short, held = _dipping_job(30), _dipping_job(300)
    default = config.AnalyzerConfig()
    assert drops(short, default) == []
    anytime = config.AnalyzerConfig(mfu=config.MfuConfig(min_drop_s=0.0))
    assert [f.step_start for f in drops(short, anytime)] == [200]
    [drop] = drops(held, default)
    assert drop.step_start == 200
    began = next(r.start_s for r in held if isinstance(r, schema.StepRecord) and r.step == 200)
    assert 3.0 <= drop.detected_s - began < 3.2  # within a step or two of lasting 3 s


# Jobs as their ranks observe them (`tests/support/observed.py`, as bench/detect.py makes them).
# 64 DDP ranks jittering +-14 % a step, hiccups and bursts of CPU load: rank 0 1.25x slow in
# backward from step 23. Its compute does not move the max over ranks that jitter sets.
OBSERVED_STRAGGLER = ob.JobConfig(
    job_id="wide", dp=64, ranks_per_node=4, layers=4, buckets=3, num_steps=48, compute_s=0.914,
    data_s=0.026, dp_transfer_s=0.0914, jitter=0.14, hiccup_rate=0.0038, load_bursts=2,
    heartbeat_loss=0.18, seed=3081,
    faults=(ob.Fault(kind=ob.FaultKind.STRAGGLER, rank=0, start_step=23, factor=1.25,
                     position=ob.Position.BACKWARD),),
)  # fmt: skip
# 4 x 4 ranks (tp inside a node, dp across): rank 7's NIC moves bytes 2.75x slower from step 24.
OBSERVED_SLOW_LINK = ob.JobConfig(
    job_id="link", tp=4, dp=4, ranks_per_node=4, ddp=False, layers=4, num_steps=49,
    compute_s=0.752, data_s=0.0287, dp_transfer_s=0.115, jitter=0.036, hiccup_rate=0.0017,
    load_bursts=2, clock_offset_s=0.2, heartbeat_loss=0.11, seed=3075,
    faults=(ob.Fault(kind=ob.FaultKind.SLOW_LINK, rank=7, start_step=24, factor=2.75),),
)  # fmt: skip


def _observed(cfg: ob.JobConfig) -> arrays.StepArrays:
    return arrays.from_records(ob.run(cfg).all_records(), job_id=cfg.job_id)


def test_a_drop_no_part_of_the_step_explains_names_no_cause_and_folds_into_the_straggler() -> None:
    """The job's MFU dropped 8 %, and the largest growth among step time's parts was 0.2 % of
    the step (communication), which was named its cause, a second, wrong finding beside the
    straggler's. A cause must account for a quarter of the growth the drop implies."""
    a = _observed(OBSERVED_STRAGGLER)
    [drop] = mfu.detect(a, config.MfuConfig())
    assert "cause unclear" in drop.summary and drop.subjects.ranks == [], drop.summary
    step = next(e for e in drop.evidence if e.metric == "step_time")
    assert step.observed > step.baseline  # what the drop implies
    found = engine.analyze_arrays(a)
    assert [(f.kind, f.subjects.ranks) for f in found] == [(schema.FindingKind.STRAGGLER, [0])]
    assert any(e.metric == "mfu" and "job mfu from step" in e.note for e in found[0].evidence)


def test_a_drop_blamed_on_communication_is_the_slow_links_evidence() -> None:
    a = _observed(OBSERVED_SLOW_LINK)
    [drop] = mfu.detect(a, config.MfuConfig())
    assert drop.summary.endswith(": communication slowdown"), drop.summary
    found = engine.analyze_arrays(a)
    assert [f.kind for f in found] == [schema.FindingKind.SLOW_LINK], [f.summary for f in found]
    assert 7 in found[0].subjects.ranks
    assert any(e.metric == "mfu" for e in found[0].evidence)


def test_a_drop_is_folded_only_into_a_finding_of_its_cause_over_its_steps() -> None:
    def finding(
        kind: schema.FindingKind, summary: str, start: int, ranks: list[int]
    ) -> schema.Finding:
        return findings.make_finding(
            kind=kind, job_id="j", subjects=schema.Subjects(ranks=ranks), step_start=start,
            step_end=start + 20, summary=summary,
            evidence=[findings.evidence("mfu", 0.3, 0.4, note="drop 25.0%; z 9.0")],
            confidence=0.8,
        )  # fmt: skip

    comm = finding(Kind.MFU_DROP, "mfu dropped 25.0% at step 40: communication slowdown", 40, [])
    unclear = finding(Kind.MFU_DROP, f"mfu dropped 25.0% at step 40: {mfu.UNCLEAR_LABEL}", 40, [])
    link = finding(Kind.SLOW_LINK, "slow link a <-> b", 38, [4, 5])
    straggler = finding(Kind.STRAGGLER, "rank 3: compute straggler", 41, [3])
    late = finding(Kind.STRAGGLER, "rank 3: compute straggler", 100, [3])
    window = config.StragglerConfig().window
    assert mfu.explains(link, comm, window) and not mfu.explains(straggler, comm, window)
    assert mfu.explains(straggler, unclear, window) and mfu.explains(link, unclear, window)
    assert not mfu.explains(late, unclear, window)  # steps far apart
    assert [f.kind for f in mfu.fold([comm, straggler], window)] == [Kind.MFU_DROP, Kind.STRAGGLER]
    assert [f.kind for f in mfu.fold([unclear, straggler], window)] == [Kind.STRAGGLER]
