"""A rank whose forward pass got slower than its own earlier steps while its peers' did not.

data/jsonl_forward_shift/ holds the SDK's own JSONL of two real 4-rank gloo jobs
(`tests/realjobs/train.py`, wrapper `pp`: a 1F1B pipeline of four stages, one per rank, on 2
shared cores), from `bench/faults.py`:

- pp-slow1.1-forward/: from step 8 a forward layer of rank 2's stage spins 10 % of the job's
  step (the job 1.1x slower). The four stages compute ~6 ms each of a ~27 ms step and differ
  among themselves by about as much: compared with its peers the slow stage was never
  reported (nor in earlier matrix runs). Its forward time went from ~3 ms to ~6 ms.
- pp-slow1.1-forward-loaded/: the same case in a matrix run beside two busy processes left
  over on the host: rank 2's forward went from ~3.4 ms to ~13 ms. Its episode was flagged
  in 14 steps for that shift and in 3 for a wait for a CPU, and was once taken for a wait for
  a CPU (more of those flags than of compute's), which had not lasted 3 s: not reported.
- pp-clean-cpu_hog-1/: no fault; a busy process on every core.
- pp-cpu-starved/: steps 980-1060 of a 2,000-step run of that clean job (`bench/faults.py
  --long`). From step ~1034 the scheduler kept rank 0's thread off a CPU in the middle of its
  forward pass: its forward time read 4.6x its earlier one in 8 of 9 steps while its wait
  for a CPU (`StepRecord.cpu_wait_s`) grew as much.
- pp-slow1.1-optimizer/: from step 8 rank 0 (the first stage) spins 10 % of the job's step
  after its optimizer step, outside its schedule; the SDK timed the schedules
  (`StepRecord.pipeline_s`). Its forward time did not grow, and without its time outside the
  schedule it was not reported (nor in 5 of 6 earlier matrix runs).
- pp-clean-jitter/: no fault; every rank sleeps 0-30 % of a step (independently, each step)
  before its schedule: outside it, where the stage slowed after its optimizer step is.
- pp-slow1.1-backward/: from step 8 a layer of rank 3's stage (the last) spins 10 % of the
  job's step in its backward passes; the SDK timed the stage's backward passes
  (`StepRecord.stage_backward_s`). Neither its forward time nor its time outside the schedule
  grew, and without its backward time it was not reported (nor in the matrix run before).
- pp-clean-cpu_hog-timed/: no fault, a busy process on every core, in that same run: its
  stages' own backward times moved by 4.2 % of the step at most.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tests.analyzer import recorded
from vigil import schema
from vigil.analyzer import arrays, config, forward_shift, jobstream, stragglers

DATA = recorded.DATA / "jsonl_forward_shift"
ONSET = 8
OFF = config.AnalyzerConfig(straggler=config.StragglerConfig(min_shift=9.0))


def _named_from_its_own(
    mode: str,
    records: list[schema.Record],
    rank: int,
    metric: str,
    peers_metric: str,
    *,
    grew: float,
    peers_below: float,
) -> None:
    """The job's one finding names `rank` a straggler, within 20 steps of the onset, by its
    own `metric` against its earlier steps (up more than `grew` times), its peers' ratio of
    the same (`peers_metric`) under `peers_below`."""
    (found,) = recorded.analyse(mode, records)
    assert (found.kind, found.subjects.ranks) == (schema.FindingKind.STRAGGLER, [rank])
    assert metric in found.summary and "its own earlier steps" in found.summary
    head = found.evidence[0]
    assert head.metric == metric and head.observed > grew * head.baseline
    peers = next(e for e in found.evidence if e.metric == peers_metric)
    assert peers.observed < peers_below
    a = arrays.from_records(records)
    row = int(np.searchsorted(a.step_end_s, found.detected_s))
    assert int(a.steps[row]) - ONSET <= 20, found.detected_s


def _zeroed(records: list[schema.Record], **fields: float) -> list[schema.Record]:
    """The records with these step-record fields 0, as an SDK that does not time them sends."""
    return [
        msgspec.structs.replace(r, **fields) if isinstance(r, schema.StepRecord) else r
        for r in records
    ]


@pytest.mark.parametrize("mode", ["offline", "online"])
@pytest.mark.parametrize("job", ["pp-slow1.1-forward", "pp-slow1.1-forward-loaded"])
def test_a_stage_slowed_by_a_tenth_of_a_step_in_its_forward_pass_is_named(
    job: str, mode: str
) -> None:
    records = recorded.records(DATA / job)
    # The other stages' forward passes did not grow.
    _named_from_its_own(
        mode, records, 2, "forward_time", "peers_forward_ratio", grew=1.5, peers_below=1.2
    )
    # Compared with its peers alone (the forward shift off), the stage is not reported.
    assert recorded.analyse(mode, records, OFF) == []


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_clean_pipeline_on_a_loaded_host_has_no_finding(mode: str) -> None:
    records = recorded.records(DATA / "pp-clean-cpu_hog-1")
    assert recorded.analyse(mode, records) == []
    a = arrays.from_records(records)
    cfg = config.StragglerConfig()
    shifted = forward_shift.shift(a, stragglers._step_reference(a, cfg), cfg)
    assert shifted is not None
    assert 0 < float(np.nanmax(shifted.share)) < cfg.min_shift
    assert not shifted.flags.any()


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_stage_slowed_after_its_optimizer_step_is_named_from_its_time_outside_the_schedule(
    mode: str,
) -> None:
    records = recorded.records(DATA / "pp-slow1.1-optimizer")
    # The other stages' own time outside did not grow.
    _named_from_its_own(
        mode,
        records,
        0,
        "outside_pipeline_time",
        "peers_outside_pipeline_ratio",
        grew=3,
        peers_below=1.3,
    )
    # Its schedule untimed (an older SDK), the stage is not reported.
    untimed = _zeroed(records, pipeline_s=0.0, pipeline_cpu_wait_s=0.0, pipeline_comm_wait_s=0.0)
    assert recorded.analyse(mode, untimed) == []


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_clean_pipeline_jittering_outside_its_schedule_has_no_finding(mode: str) -> None:
    records = recorded.records(DATA / "pp-clean-jitter")
    a = arrays.from_records(records)
    assert a.pipeline_own_s is not None and np.isfinite(a.pipeline_own_s).all()
    assert recorded.analyse(mode, records) == []


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_stage_slowed_in_its_backward_passes_is_named_from_its_own_time_there(
    mode: str,
) -> None:
    records = recorded.records(DATA / "pp-slow1.1-backward")
    # The other stages' own backward times did not grow.
    _named_from_its_own(
        mode,
        records,
        3,
        "stage_backward_time",
        "peers_stage_backward_ratio",
        grew=1.5,
        peers_below=1.2,
    )
    # Its backward passes untimed (an older SDK), the stage is not reported.
    untimed = _zeroed(records, stage_backward_s=0.0, stage_backward_wait_s=0.0)
    assert recorded.analyse(mode, untimed) == []


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_clean_pipeline_on_a_loaded_host_has_no_backward_shift(mode: str) -> None:
    records = recorded.records(DATA / "pp-clean-cpu_hog-timed")
    a = arrays.from_records(records)
    assert a.stage_backward_own_s is not None and np.isfinite(a.stage_backward_own_s).all()
    cfg = config.StragglerConfig()
    shifted = forward_shift.backward_shift(a, cfg)
    assert shifted is not None
    share = shifted / stragglers._step_reference(a, cfg)
    assert float(np.nanmax(share[cfg.warmup_steps :])) < cfg.min_shift
    assert recorded.analyse(mode, records) == []


def test_a_stages_own_backward_time_leaves_out_its_waits_there() -> None:
    backward = np.array([0.012, 0.015, 0.0])
    waits = np.array([0.002, 0.016, 0.0])  # a CPU wait and a gradient all-reduce in there
    own = arrays.stage_backward_own(backward, waits)
    assert own[:2] == pytest.approx([0.010, 0.0])
    assert np.isnan(own[2])  # none timed


def test_a_stages_own_backward_time_shifts_alone() -> None:
    base = 0.005 * np.random.default_rng(2).uniform(0.95, 1.05, (STEPS, RANKS))
    own = base.copy()
    own[30:, 1] += 0.1 * STEP_S  # a slow layer in its backward passes from step 30
    a = _job(_stages())
    a.stage_backward_own_s = own.astype(np.float32)
    shifted = _shift(a)
    flagged = np.flatnonzero(shifted.flags[:, 1])
    assert flagged.size >= 8 and 30 < flagged[0] <= 30 + 6
    assert shifted.backward[flagged, 1].all() and not shifted.outside[flagged, 1].any()
    assert not shifted.flags[:, [0, 2, 3]].any()


def test_a_stages_own_time_outside_its_schedule_leaves_out_its_waits_there() -> None:
    step = np.array([0.100, 0.100, 0.100, 0.050])
    data = np.array([0.005, 0.005, 0.005, 0.0])
    comm = np.array([0.040, 0.040, 0.055, 0.0])  # the third also waits 15 ms outside
    cpu = np.array([0.010, 0.010, 0.010, 0.0])
    pipeline = np.array(
        [
            [0.080, 0.006, 0.040],  # inside: time, its CPU wait, its waits for peers
            [0.080, 0.010, 0.040],
            [0.065, 0.006, 0.040],
            [0.0, 0.0, 0.0],  # no schedule timed
        ]
    )
    own = arrays.pipeline_own(step, data, comm, cpu, pipeline)
    assert own[:3] == pytest.approx([0.011, 0.015, 0.011])
    assert np.isnan(own[3])


def _outside_job(own: np.ndarray) -> arrays.StepArrays:
    a = _job(_stages())
    a.pipeline_own_s = own.astype(np.float32)
    return a


def test_a_stages_own_time_outside_its_schedule_shifts_alone() -> None:
    base = 0.002 * np.random.default_rng(1).uniform(0.9, 1.1, (STEPS, RANKS))
    own = base.copy()
    own[30:, 3] += 0.1 * STEP_S  # spins after its optimizer step from step 30
    shifted = _shift(_outside_job(own))
    flagged = np.flatnonzero(shifted.flags[:, 3])
    assert flagged.size >= 8 and 30 < flagged[0] <= 30 + 6
    assert shifted.outside[flagged, 3].all()
    assert not shifted.flags[:, :3].any()
    every = base.copy()
    every[30:] += 0.1 * STEP_S  # every stage at once (a job-wide evaluation): no one's
    assert not _shift(_outside_job(every)).flags.any()


# Synthetic jobs: 4 ranks doing different work (a pipeline's stages), 60 steps of 100 ms.
STEPS, RANKS, STEP_S = 60, 4, 0.1


def _job(
    forward: np.ndarray,
    wait: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
    cpu_wait: np.ndarray | None = None,
    forward_cpu_wait: np.ndarray | None = None,
) -> arrays.StepArrays:
    shape = (STEPS, RANKS)
    f32 = np.float32
    ends = np.arange(1, STEPS + 1, dtype=np.float64) * STEP_S
    return arrays.StepArrays(
        job_id="j",
        steps=np.arange(STEPS, dtype=np.int64),
        ranks=np.arange(RANKS, dtype=np.int64),
        step_time_s=np.full(shape, STEP_S, dtype=f32),
        data_s=np.zeros(shape, dtype=f32),
        comm_wait_s=(np.full(shape, 0.02) if wait is None else wait).astype(f32),
        transfer_s=np.full(shape, np.nan, dtype=f32),
        tokens=(np.full(shape, 1000.0) if tokens is None else tokens).astype(f32),
        mfu=np.zeros(shape, dtype=f32),
        step_start_s=ends - STEP_S,
        step_end_s=ends,
        nodes=("n",) * RANKS,
        stages=np.arange(RANKS, dtype=np.int32),  # a declared pipeline, one rank a stage
        forward_s=forward.astype(f32),
        cpu_wait_s=None if cpu_wait is None else cpu_wait.astype(f32),
        forward_cpu_wait_s=None if forward_cpu_wait is None else forward_cpu_wait.astype(f32),
    )


def _stages(seed: int = 0) -> np.ndarray:
    """Forward times of 4 stages of unlike size, each jittering ±3 % a step."""
    rng = np.random.default_rng(seed)
    levels = np.array([0.010, 0.020, 0.015, 0.030])
    return levels * rng.uniform(0.97, 1.03, (STEPS, RANKS))


def _shift(a: arrays.StepArrays) -> forward_shift.Shift:
    cfg = config.StragglerConfig()
    shifted = forward_shift.shift(a, stragglers._step_reference(a, cfg), cfg)
    assert shifted is not None
    return shifted


def test_a_ranks_own_slowdown_is_flagged_from_soon_after_its_onset() -> None:
    forward = _stages()
    forward[30:, 1] += 0.1 * STEP_S  # 10 % of the step, onset at step 30
    shifted = _shift(_job(forward))
    flagged = np.flatnonzero(shifted.flags[:, 1])
    assert flagged.size >= 8 and 30 < flagged[0] <= 30 + 6
    assert not shifted.flags[:, [0, 2, 3]].any()
    assert shifted.share[flagged[0] + 4, 1] == pytest.approx(0.1, abs=0.02)
    # ... and reported, with its own earlier forward time as the baseline.
    (found,) = stragglers.detect(_job(forward), config.StragglerConfig())
    assert found.subjects.ranks == [1]
    assert found.evidence[0].baseline == pytest.approx(0.02, rel=0.05)


def test_every_rank_slowing_alike_is_no_ranks_shift() -> None:
    forward = _stages()
    forward[30:] += 0.1 * STEP_S  # an evaluation, a busy host: every stage at once
    assert not _shift(_job(forward)).flags.any()


def test_a_forward_pass_that_grew_by_its_wait_for_a_peer_is_not_its_own_shift() -> None:
    forward, wait = _stages(), np.full((STEPS, RANKS), 0.02)
    forward[30:, 2] += 0.1 * STEP_S  # a receive inside its forward waits for a slow peer
    wait[30:, 2] += 0.1 * STEP_S
    wait[30:, 3] += 0.1 * STEP_S  # ... a peer whose wait grew elsewhere keeps its forward
    assert not _shift(_job(forward, wait)).flags.any()


def test_a_forward_pass_that_grew_by_its_wait_for_a_cpu_is_not_its_own_shift() -> None:
    """A busy process on the host takes the CPU in the middle of a rank's forward pass (a clean
    pipeline under such load read a stage's forward 4.6x its earlier one, 8 of 9 steps)."""
    forward, cpu_wait = _stages(), np.zeros((STEPS, RANKS))
    forward[30:, 0] += 0.1 * STEP_S
    cpu_wait[30:, 0] += 0.1 * STEP_S
    assert not _shift(_job(forward, cpu_wait=cpu_wait)).flags.any()
    assert _shift(_job(forward)).flags[:, 0].any()  # ... unknown, it would be flagged


def test_only_the_cpu_wait_inside_the_forward_pass_is_taken_out_of_its_growth() -> None:
    """A stage slowed by a tenth of a step before its forward layer, on a host with fewer cores
    than ranks: sleeping, it gives its core away, and its step's wait for a CPU grows as well
    (after its sleep, and later in the step), by about as much as its forward pass. Taken out
    whole, that growth hid the slowdown (the fault matrix's pipeline 1.1x forward case was
    missed so). The SDK's forward hooks measure the part inside the forward pass: only that is
    not the stage's own."""
    forward, cpu_wait, in_forward = _stages(), np.zeros((STEPS, RANKS)), np.zeros((STEPS, RANKS))
    forward[30:, 2] += 0.1 * STEP_S + 0.02 * STEP_S  # its slowdown, and a wait for a CPU
    in_forward[:, :] = 0.005 * STEP_S  # a little wait inside every forward pass ...
    in_forward[30:, 2] += 0.02 * STEP_S  # ... and the slow stage's wait after its sleep
    cpu_wait[:, :] = 0.02 * STEP_S
    cpu_wait[30:, 2] += 0.1 * STEP_S  # its step's whole wait grew by as much as its forward
    shifted = _shift(_job(forward, cpu_wait=cpu_wait, forward_cpu_wait=in_forward))
    flagged = np.flatnonzero(shifted.flags[:, 2])
    assert flagged.size >= 8 and not shifted.flags[:, [0, 1, 3]].any()
    assert shifted.share[flagged[0] + 4, 2] == pytest.approx(0.1, abs=0.02)
    # Not measured (an older SDK, 0), the step's whole wait is taken out, as before: missed.
    assert not _shift(_job(forward, cpu_wait=cpu_wait)).flags[:, 2].any()
    unknown = np.zeros((STEPS, RANKS))
    assert not _shift(_job(forward, cpu_wait=cpu_wait, forward_cpu_wait=unknown)).flags.any()
    # A forward pass that grew by its wait for a CPU inside it alone is still not its own.
    in_forward[30:, 2] += 0.1 * STEP_S
    assert not _shift(_job(forward, cpu_wait=cpu_wait, forward_cpu_wait=in_forward)).flags.any()


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_a_clean_stage_kept_off_a_cpu_in_its_forward_pass_is_no_straggler(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = recorded.records(DATA / "pp-cpu-starved")
    assert recorded.analyse(mode, records) == []
    # Its wait for a CPU unknown, its forward pass's growth would be its own.
    shift = forward_shift.shift

    def unknown_cpu_wait(a: arrays.StepArrays, *args: object) -> forward_shift.Shift | None:
        a.cpu_wait_s = None
        return shift(a, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(forward_shift, "shift", unknown_cpu_wait)
    assert recorded.named(recorded.analyse(mode, records)) == [("straggler", [0])]


def test_a_forward_pass_grown_with_its_tokens_is_compared_per_token() -> None:
    forward = _stages()
    tokens = np.full((STEPS, RANKS), 1000.0)
    tokens[::3, :] = 800.0  # the ranks' tokens vary from step to step
    forward *= tokens / 1000.0
    forward[30:, 1] *= 1.5  # rank 1's sequences grew half as long again: so did its forward
    tokens[30:, 1] *= 1.5
    assert not _shift(_job(forward, tokens=tokens)).flags.any()


def test_no_forward_time_known_means_no_shift() -> None:
    a = _job(np.zeros((STEPS, RANKS)))  # no model watched
    cfg = config.StragglerConfig()
    assert forward_shift.shift(a, stragglers._step_reference(a, cfg), cfg) is None


def test_the_earlier_level_is_the_median_of_three_windows_before() -> None:
    cfg = config.StragglerConfig()
    w = cfg.smooth_steps
    x = np.ones((6 * w, 1), dtype=np.float32)
    x[4 * w :] = 2.0  # a shift that began 2 windows ago moves one of the three levels only
    level = forward_shift.levels(x, cfg)
    assert level[5 * w, 0] == pytest.approx(1.0)
    assert level[6 * w - 1, 0] == pytest.approx(1.0)
    assert np.isnan(level[: w - 1, 0]).all() and level[w, 0] == pytest.approx(1.0)


def test_only_ranks_doing_different_work_are_compared_with_their_own_past() -> None:
    own = stragglers.compares_own_forward
    assert own(np.arange(4, dtype=np.int32), sends_p2p=False)  # 4 stages of one rank
    assert own(np.repeat(np.arange(4, dtype=np.int32), 2), sends_p2p=False)  # ... of two
    assert not own(np.repeat(np.arange(4, dtype=np.int32), 3), sends_p2p=True)  # within stages
    assert own(None, sends_p2p=True)  # a pipeline nobody declared: its ranks send each other p2p
    assert not own(None, sends_p2p=False)  # data-parallel peers: same work
    # ... and where they are not, nothing flags their forward passes.
    forward = _stages()
    forward[30:, 1] += 0.1 * STEP_S
    a = _job(forward)
    a.stages = None
    scores = stragglers.score(a, config.StragglerConfig())
    assert not scores.forward.any()


@pytest.mark.parametrize("value", [0.0, -0.1, 10.0])
def test_a_bad_min_shift_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match=r"min_shift must be in \(0, 10\), got "):
        config.StragglerConfig(min_shift=value)


def test_online_the_finding_stays_open_while_the_stage_stays_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its earlier forward time comes to hold the slow steps, and its flags end (step ~28
    here) while the stage stays slow to the job's end: its finding is not resolved. (A
    persistence window of 6 steps, so that its hits run out within this 40-step job.)"""
    records = recorded.records(DATA / "pp-slow1.1-forward")
    short = config.AnalyzerConfig(straggler=config.StragglerConfig(window=6, min_hits=4))
    a = arrays.from_records(records)
    flagged = np.flatnonzero(stragglers.score(a, short.straggler).forward[:, 2])
    assert flagged[-1] < a.num_steps - short.straggler.window  # its hits ran out
    (found,) = recorded.streamed(records, short, last_state=True)
    assert found.subjects.ranks == [2] and found.state is schema.FindingState.OPEN
    # Closed as the hits ran out, it would have been resolved while the stage was slow.
    monkeypatch.setattr(jobstream.JobStream, "_still_shifted", lambda *_: False)
    (found,) = recorded.streamed(records, short, last_state=True)
    assert found.state is schema.FindingState.RESOLVED
