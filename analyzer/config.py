"""Tunable thresholds of the detectors, as typed keyword-only dataclasses that validate themselves.

Pure configuration: no I/O, no imports of other vigil subsystems. Each default carries the reason
it was chosen; change them through `AnalyzerConfig(straggler=StragglerConfig(...), ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """When a rank's compute, data or transfer time is an outlier, and for how long."""

    # Robust z (median/MAD) above which a rank is an outlier at one step; 4 keeps clean jobs of
    # 1,000+ ranks quiet while a 10 % slowdown with 2 % jitter still scores ~5.
    z_threshold: float = 4.0
    # ... or `corroborated_z` when its communication wait is as far below its peers' (a low
    # outlier at that z, by the same excess below): a straggler both computes more and waits
    # least, two readings with noises of their own (CPU wait is taken out of compute only).
    # On 446 recorded real 4-rank jobs (152 clean) 3 found 5 more stragglers than 4 alone,
    # and 4 fewer of them late, naming no clean rank; 2 named two. Only in groups smaller than
    # `scale_samples`: among thousands of ranks both readings of one steady rank reach z 3.
    corroborated_z: float = 3.0
    # ... or `small_group_z` alone where its ranks do the same work (not a pipeline's stages
    # scored together: their computes are no peers'). How many clean ranks a bar names grows
    # with how many ranks it judges, so thousands keep z 4, while in 4 ranks a straggler at
    # this machine's noise edge stays under it. Real 4-rank DDP jobs of the fault matrix on
    # 2 shared cores (steps of 30-100 ms): a rank slowed 1.1x in backward scored z 3-4 for 12
    # straight steps, flagged at 4 in 5 of them, and was not reported; one slowed 1.1x in its
    # optimizer step was reported 19 steps after onset. At 3.5: after 7 steps, both. Over every
    # clean real job in tests/analyzer/data, the last matrix's and 12,000 clean steps
    # of `bench/faults.py --long 500 --wrappers ddp,plain,fsdp,tp` (jitter, hiccups, a busy
    # process on every core) it named no rank: a clean rank was flagged in at most 7 of 12
    # steps (at 4: 6), but for one plain loop's rank, persistent at 4 too, whose own steps
    # carry no evidence (1.2, `excess.py`). At 3, a rank of a job beside busy processes was
    # flagged in 7 of 12 steps with evidence 12.9 (12 is needed), so 3 stays corroborated.
    small_group_z: float = 3.5
    # ... and it must also be late by this share of the step's median step time (compute and
    # data time; a link's transfer time: of its median): tiny MADs on very regular jobs would
    # otherwise turn 1 % wobbles into huge z-scores, healthy GPUs of one model differ by a few
    # percent (silicon, cooling), and a rank whose compute is a small part of its step (most
    # of it in collectives) must not be flagged for a large share of that small part. A
    # straggler that makes the job 10 % slower is late by 10 % of the step. 4 % with the
    # persistence below kept every clean real job of bench/faults.py quiet (jitter, hiccups, a
    # CPU-burning neighbour); 6 % with 5 of 8 steps did not.
    min_excess: float = 0.04
    # Persistence: an outlier in at least `min_hits` of the last `window` steps is reported;
    # 8 of 12 rides over one-off hiccups (GC, page faults) and over a noisy neighbour taking a
    # core for 5-6 steps (seen on real jobs), and still reports within about 12 steps.
    window: int = 12
    min_hits: int = 8
    # Each rank's signals are averaged over its last `smooth_steps` steps, the largest left out,
    # before scoring: 8 cuts per-step jitter by ~2.6x, so 10 % stragglers stand out with ~6 %
    # jitter, while one slow step (a GC pause) is dropped from every window it falls in.
    smooth_steps: int = 8
    # The first `warmup_steps` steps of a job are not scored: start-up (allocator and
    # thread-pool warm-up, compilation, data-loader workers starting, a checkpoint loading) is
    # unlike the run and uneven across ranks, and a rank's smoothing window is not yet full. On
    # a real clean DDP job one rank ran 1.3x slower for its steps 2-10 while its host was busy,
    # and was reported; a straggler present from step 0 is still reported by step ~18.
    warmup_steps: int = 8
    # A compute straggler must also carry enough evidence in its unsmoothed steps: its compute
    # less its peers' median (the others', so 3 peers' median is not its own value), over the
    # robust scale of those per-step deviations (the group's ranks over its last steps, at
    # least `scale_samples` deviations), clipped at `evidence_clip` (one hiccup adds at most
    # 3.5; at 6 a clean DDP rank's run of high draws with hiccups among them passed, one in
    # 1,500 steps of a real job with a hiccup every 50 steps; at 4 bench/detect.py's
    # intermittent stragglers, 2x every 4th step, carry it ~5 steps later than at 6, and 3 of
    # 24 are not found within its 20 steps), less `evidence_allowance` a step, summed over its
    # best run of its last 1 to `evidence_steps` steps (a CUSUM that forgets), must exceed
    # `evidence_threshold`. A steady-shaped episode's runs leave their largest step out
    # (`excess.accumulate`): a clean DDP rank of the fault matrix with two hiccups (3.5 each
    # at the clip) in a run of high draws carried 14.45 and was reported a 1.11x straggler.
    # Smoothed z-scores alone let a clean rank's run of high jitter draws through (a rank of a
    # 4-rank job jittering ±15 % a step: ~3 standard deviations over ~12 steps, about once in
    # 10,000 clean steps): the spread of 4 ranks reads ~1.4x low. Over 12,000 steps of real
    # clean 4-rank jobs a rank's sum reached 4-16 (a quiet host's hiccups add up; its ranks
    # are seldom persistent outliers), and the four runs that had been reported as
    # stragglers carried 2-8. On the real-job fault matrix every straggler found before is
    # still found (16 missed one intermittent straggler more), and its clean ranks' sums stay
    # under 10: a 1.1x straggler there passes 12 within 3-14 steps (a pipeline's stage within
    # 10-17 steps or not at all), a 1.25x one within 1-10, so persistence (8 of 12) still
    # decides most reports. In a job jittering ±15 % a step a 1.1x straggler needs ~48 steps,
    # a 1.25x one 18-24, a 1.5x one 7-8 (~40, 15-21 and 6-7 with every step counted).
    evidence_allowance: float = 0.5
    evidence_clip: float = 4.0
    evidence_steps: int = 48
    evidence_threshold: float = 12.0
    # ... or, since the clip caps each slow step of a rank slow only every few steps (and its
    # other steps, at its peers' level, give back up to the clip each), at least
    # `periodic_excursions` of its last `evidence_steps` steps at `evidence_clip` or more that
    # fall on one phase of a period (`shape.period`: 2-16 steps). Real 4-rank jobs 2x slow every
    # 4th step: 26 of 26 (6 matrices) reach 6 within 20 steps of onset; over 110,140 steps of
    # real clean jobs (hiccups, ±15 % jitter, a busy process on every core) one rank once had 5
    # such steps at a period (9), never 6, while unordered excursions reached 9 in 48 steps.
    periodic_excursions: int = 6
    # A compute straggler flagged in only `strong_hits` of the last `window` steps (short of
    # `min_hits`) is reported once its accumulated excess reaches `strong_evidence` x
    # `evidence_threshold`: two readings of one slowdown, its smoothed scores and its own
    # unsmoothed steps, the second strong enough to need at least 8 steps late (7 at the clip,
    # less the allowance, its largest left out), so a neighbour taking a core for 5-6 steps
    # cannot carry it; a job's start-up steps count nothing in it. Real 4-rank DDP jobs of
    # the fault matrix on 2 shared cores, a rank slowed 1.1x in its optimizer step: its
    # smoothed compute dipped under the bar for 4-5 steps between runs of flags while its own
    # steps kept carrying evidence (20-27 while flagged in 6 of 12), and it was reported 21
    # and 23 steps after onset; with this rule after 17 and 13. Replayed offline over 654
    # recorded real jobs (8 matrices, long clean runs, tests/analyzer/data) no clean job got a
    # finding and 127 faults came 1-2 steps sooner (one 4, one 10), none later (online, their
    # clean, 1.1x and ramp jobs: the same); a clean rank flagged in 6 of 12 steps carried at
    # most 11.8 (beside busy processes), 6.9 among the rest. Steady episodes only: an
    # intermittent straggler's evidence keeps its largest steps. At `min_hits` or more the
    # rule is off.
    strong_hits: int = 6
    strong_evidence: float = 2.0
    # A rank whose forward pass (the SDK's module hooks) became slower than its own earlier
    # steps by `min_shift` of the step, less its peers' change, is flagged as a compute
    # straggler is, with the persistence above (`forward_shift.py`; its earlier level: the
    # median of its smoothed levels 1, 2 and 3 smoothing windows before). Only where ranks
    # scored together do different work (a pipeline's stages), whose computes cannot be
    # compared with each other's. A real 4-stage pipeline's stage slowed 1.1x in its forward
    # pass shifts by 10-20 % of the step; over 24,000 clean pipeline steps of bench/faults.py
    # (`--long 2000 --wrappers pp`, jitter, hiccups, a busy process on every core) a clean
    # stage reached 5 % in at most 5 of 12 steps, and 9.9 % in one step.
    min_shift: float = 0.05
    # A pipeline stage's shift in its own time outside its schedule (`forward_shift.
    # outside_shift`) counts only where it is also at least `outside_noise_ratio` times its
    # usual step-to-step change there before (what jitter outside the schedule, a data loader
    # or the user's own code, moves it by). Real 4-stage pipelines: a stage spinning 10 % of
    # the step after its optimizer step shifted by 8-73x its usual change (five runs); with
    # every stage sleeping 0-30 % of a step before its schedule (the matrix's jitter), clean
    # stages shifted by 5-20 % of the step, at most 3.5x their usual change (flagged at
    # `min_shift` alone: 4 findings in 2,400 clean steps).
    outside_noise_ratio: float = 3.0
    # ... and its shift in its own time in its backward passes (`forward_shift.backward_shift`)
    # at least `backward_noise_ratio` times its usual change there. That time holds no wait for
    # a peer: on the real 4-stage pipelines of the fault matrix (one run, 24 jobs) clean stages
    # shifted by 4.2 % of the step at most, 2 steps at 5 %+ (7.4 %, beside a noisy neighbour),
    # and a stage slowed 1.1x in backward by 14 %, 18 steps at 5 %+. Its usual change includes
    # the job's first, noisier steps when the fault starts soon after them: at 3 that 1.1x
    # stage was left with 3 steps, at 1 with all 18 (and the neighbour's one step with 2).
    backward_noise_ratio: float = 1.0
    # The robust scale is taken over at least `scale_samples` rank-steps: one step's MAD over 4
    # ranks is decided by two of their deviations and swings by 2x from step to step (on real
    # 4-rank pipelines it let clean ranks score z > 4 and kept 1.25x stages at z ~3), so the
    # deviations of a group of fewer ranks are pooled over its last ceil(scale_samples / ranks)
    # steps, at most `window`. Groups of 64+ ranks are scored step by step.
    scale_samples: int = 64
    # Floor of the robust scale as a fraction of the median, so identical values never divide by 0.
    scale_floor: float = 0.005
    # Data-loader time counts only when it is at least this share of the step time.
    min_data_share: float = 0.05
    # A rank's wait for a CPU (StepRecord.cpu_wait_s) makes it a straggler only when it exceeds
    # its peers' by this share of the step, with the z and persistence above: busy processes
    # in one rank's session (the kernel's autogroup gives them that rank's share) took 29-50 %
    # of its step on real jobs, while a busy process on every core, in sessions of its own,
    # moved clean ranks' waits between 1 % and 42 % of the step, never one rank persistently.
    min_cpu_wait_share: float = 0.10
    # ... and such a straggler (flagged more for its wait for a CPU than for its compute) is
    # reported only once its episode has lasted this long: the scheduler can leave one rank
    # beside a busy process for a while when every core has one (clean 4-rank jobs on 2 cores:
    # one rank starved for 8-18 steps, 0.3-1.0 s, while its peers were not), but a process
    # that takes one rank's CPU share and keeps it (in its cgroup or session) stays.
    min_cpu_wait_episode_s: float = 3.0
    # ... or when a process group moves its bytes this many times slower than the median of its
    # peer groups (links.py): shared links and jitter move groups alike; 1.5x is a broken
    # link, a congested switch port or a NIC at a fraction of its rate.
    link_ratio: float = 1.5

    def __post_init__(self) -> None:
        _require(self.z_threshold > 0, f"z_threshold must be > 0, got {self.z_threshold}")
        _require(
            0 < self.corroborated_z <= self.z_threshold,
            f"corroborated_z must be in (0, z_threshold={self.z_threshold}], "
            f"got {self.corroborated_z}",
        )
        _require(
            0 < self.small_group_z <= self.z_threshold,
            f"small_group_z must be in (0, z_threshold={self.z_threshold}], "
            f"got {self.small_group_z}",
        )
        _require(0 <= self.min_excess < 10, f"min_excess must be in [0, 10), got {self.min_excess}")
        _require(self.window >= 1, f"window must be >= 1 step, got {self.window}")
        _require(
            1 <= self.min_hits <= self.window,
            f"min_hits must be in [1, window={self.window}], got {self.min_hits}",
        )
        _require(self.smooth_steps >= 1, f"smooth_steps must be >= 1, got {self.smooth_steps}")
        _require(0 < self.min_shift < 10, f"min_shift must be in (0, 10), got {self.min_shift}")
        _require(
            self.outside_noise_ratio > 0,
            f"outside_noise_ratio must be > 0, got {self.outside_noise_ratio}",
        )
        _require(
            self.backward_noise_ratio > 0,
            f"backward_noise_ratio must be > 0, got {self.backward_noise_ratio}",
        )
        _require(
            self.evidence_allowance >= 0,
            f"evidence_allowance must be >= 0, got {self.evidence_allowance}",
        )
        _require(
            self.evidence_clip > self.evidence_allowance,
            f"evidence_clip must be > evidence_allowance={self.evidence_allowance}, "
            f"got {self.evidence_clip}",
        )
        _require(
            self.evidence_steps >= 1, f"evidence_steps must be >= 1, got {self.evidence_steps}"
        )
        _require(
            self.evidence_threshold >= 0,
            f"evidence_threshold must be >= 0, got {self.evidence_threshold}",
        )
        _require(
            3 <= self.periodic_excursions <= self.evidence_steps,
            f"periodic_excursions must be in [3, evidence_steps={self.evidence_steps}], "
            f"got {self.periodic_excursions}",
        )
        _require(
            1 <= self.strong_hits <= self.window,
            f"strong_hits must be in [1, window={self.window}], got {self.strong_hits}",
        )
        _require(
            self.strong_evidence >= 1, f"strong_evidence must be >= 1, got {self.strong_evidence}"
        )
        _require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.scale_samples >= 1, f"scale_samples must be >= 1, got {self.scale_samples}")
        _require(0 < self.scale_floor < 1, f"scale_floor must be in (0, 1), got {self.scale_floor}")
        _require(0 <= self.min_data_share < 1, "min_data_share must be in [0, 1)")
        _require(0 <= self.min_cpu_wait_share < 1, "min_cpu_wait_share must be in [0, 1)")
        _require(
            self.min_cpu_wait_episode_s >= 0,
            f"min_cpu_wait_episode_s must be >= 0, got {self.min_cpu_wait_episode_s}",
        )
        _require(self.link_ratio > 1, f"link_ratio must be > 1, got {self.link_ratio}")


@dataclass(frozen=True, kw_only=True)
class HangConfig:
    """How long silence must last before it is a hang, learned from recent step times."""

    # A hang is declared after `factor` x the median recent step time without progress: one
    # rank's 2x hiccup (a GC pause, a page-fault storm) stretches a step to about 2x, and the
    # latency target (hangs flagged within 3x the step time) leaves half a step for the
    # heartbeat and the check that see it ...
    factor: float = 2.5
    # ... and `slow_step_factor` x the 95th percentile of recent step times, so a job whose
    # steps have just grown slower (a straggler), or whose steps often hold a hiccup (one in a
    # thousand rank-steps is, over 128 ranks, one step in eight), is not taken for a hung one;
    # 1.5x put 2 of 24 simulated hangs past the 3x-step-time target, 1.25x none ...
    slow_step_factor: float = 1.25
    # ... but never sooner than this: on ~1 s steps a 3x hiccup of one rank stalls everyone
    # for about 3 s (2 s raised `no step finished` on simulated clean jobs, and a simulated
    # clean job with ±15 % jitter, hiccups and load bursts stalled for 3.5 s). The check runs
    # as the silence passes the threshold (`HangTracker.due_s`: the collector ticks then, `vigil
    # analyze` checks then), not up to a tick later, so 4 s flags a hang within the 5 s target
    # with a second to spare for a peer's save that ends before the culprit's is held up.
    min_s: float = 4.0
    # A stall whose culprit positions cannot tell (no rank waits where the SDK sees it, none is
    # behind its peers: e.g. every rank stuck in shared storage) is a finding only after this
    # many thresholds: at one threshold it was, on real and simulated jobs, a long step.
    unknown_culprit_factor: float = 5.0
    # Until `warmup_steps` steps have been seen (compilation, first checkpoint load) the
    # threshold is this long.
    warmup_s: float = 300.0
    warmup_steps: int = 5
    # How many recent steps the median step time is taken over.
    history_steps: int = 50

    def __post_init__(self) -> None:
        _require(self.factor >= 1.0, f"factor must be >= 1, got {self.factor}")
        _require(self.min_s > 0, f"min_s must be > 0 seconds, got {self.min_s}")
        _require(self.slow_step_factor >= 1.0, "slow_step_factor must be >= 1")
        _require(self.unknown_culprit_factor >= 1.0, "unknown_culprit_factor must be >= 1")
        _require(self.warmup_s >= self.min_s, "warmup_s must be >= min_s")
        _require(self.warmup_steps >= 1, "warmup_steps must be >= 1")
        _require(self.history_steps >= 1, "history_steps must be >= 1")


@dataclass(frozen=True, kw_only=True)
class MfuConfig:
    """The windowed change-point test on per-step MFU (or throughput when MFU is unknown)."""

    # Baseline and recent windows (steps) compared by the test.
    baseline_steps: int = 30
    recent_steps: int = 8
    # Report drops of at least this fraction of the baseline (5 %: below it, noise and real
    # input-dependent variation dominate on real jobs).
    min_drop: float = 0.05
    # The drop must also be this many robust standard errors of the baseline.
    z_threshold: float = 6.0
    # ... and have lasted this long (from its change point) before it is reported: a real
    # pipeline of ~23 ms steps on a shared 2-core host, fault-free, dropped 8-31 % for 8+
    # steps five times in 1,500 steps, each over within ~0.6 s (the scheduler's, nothing a
    # user could act on). Jobs of ~0.4 s steps and slower are not held back by it (8 steps).
    min_drop_s: float = 3.0

    def __post_init__(self) -> None:
        _require(self.baseline_steps >= 4, "baseline_steps must be >= 4")
        _require(self.recent_steps >= 2, "recent_steps must be >= 2")
        _require(0 < self.min_drop < 1, f"min_drop must be in (0, 1), got {self.min_drop}")
        _require(self.z_threshold > 0, "z_threshold must be > 0")
        _require(self.min_drop_s >= 0, f"min_drop_s must be >= 0, got {self.min_drop_s}")


@dataclass(frozen=True, kw_only=True)
class AnalyzerConfig:
    """Everything the detectors need; the defaults suit jobs of 8 to 10,000 ranks."""

    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    mfu: MfuConfig = field(default_factory=MfuConfig)
    # Rolling window of steps kept per job by the streaming analyzer.
    stream_window_steps: int = 64
    # A step is analysed once all known ranks reported it, or once 90 % of the ranks reported a
    # step this many steps newer (a silent rank must not stall analysis of the others, and one
    # rank's early shipment must not get a step analysed before the other ranks' arrive).
    stream_step_lag: int = 2
    # A job that sent nothing for this long (seconds of `tick` time) is forgotten: its state
    # (~30 KiB for a small job) is freed. Hung jobs keep sending heartbeats, so stay.
    stream_job_idle_s: float = 3600.0
    # At most this many jobs are followed at once; past it the least recently seen is forgotten.
    stream_max_jobs: int = 1024

    def __post_init__(self) -> None:
        s = self.straggler
        need = max(
            s.window,
            self.mfu.baseline_steps + self.mfu.recent_steps,
            4 * s.smooth_steps + s.window,
        )
        _require(
            self.stream_window_steps >= need,
            f"stream_window_steps must be >= {need} (persistence, forward-shift and MFU windows)",
        )
        _require(self.stream_step_lag >= 0, "stream_step_lag must be >= 0")
        _require(self.stream_job_idle_s > 0, "stream_job_idle_s must be > 0")
        _require(self.stream_max_jobs >= 1, "stream_max_jobs must be >= 1")
