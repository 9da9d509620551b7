"""A rank whose forward pass (or, in a pipeline whose schedules the SDK timed, its own time
outside its schedule, `outside_shift`, or in its backward passes, `backward_shift`) became
slower than its own earlier steps while its peers' did not.

`stragglers.py` compares each rank's compute with its peers' at the same step, which needs
peers doing the same work. A pipeline's stages do not: each holds other layers, the first the
embeddings, the last the loss, so their computes differ among themselves by about as much as a
stage slowed by a tenth of the step adds (real 4-stage 1F1B jobs of the fault matrix, 4 ranks
on 2 cores: such a stage was missed in most runs), and a stage's compute (its step less its
attributed waits) also holds what its point-to-point waits leave unattributed. Its forward
pass, timed by the SDK's module hooks (`StepRecord.forward_s`), holds neither. So where ranks
scored together do different work (`stragglers.compares_own_forward`) each rank's forward time
is compared with its own:

- its change: its current level (the mean of its last `smooth_steps` steps, the largest left
  out) less its earlier level, the median of that same level 1, 2 and 3 smoothing windows
  before (`levels`; a shift that began within the last 2 windows moves one of the three);
- less as much of that growth as its waits grew by (a forward pass that holds a pipeline's
  receive or FSDP's all-gathers grows when its rank waits longer for a peer, and one the
  scheduler interrupts by its wait for a CPU: the part of it inside its forward passes,
  `StepRecord.forward_cpu_wait_s`, where the SDK measured it, else the step's `cpu_wait_s`;
  a stage slowed on a host with fewer cores than ranks gives its core away and waits for one
  more over its whole step, by about as much as its forward pass grew);
- less the median change of the other ranks (an evaluation or a busy host moves them all).

That shift is flagged where it is at least `min_shift` of the step's median step time;
persistence, the wait check (a straggler waits least) and the finding are `stragglers.py`'s.
No z-score: the robust scale of 4 ranks' shifts is decided by two of them, and one stage whose
forward pass was slow in its first steps (start-up) and then not reads a large negative shift
for 3 smoothing windows, which hid a real stage's 1.1x shift at z < 3 in one matrix run.

Where the ranks' tokens vary from step to step the forward time per token is compared instead
(a longer sequence takes longer). A forward time of 0 (no model watched) is unknown.

A stage slowed outside its forward pass, after its optimizer step, leaves its forward time as
it was; its peers wait for it inside their schedules. Where the SDK timed the schedules
(`StepRecord.pipeline_s`), a stage's own time outside its schedule, less its waits there, is
compared the same way (`outside_shift`); so is a stage's own time in its backward passes
(`backward_shift`), where one slowed there (a slow layer) shows and its peers' waits for it do
not. The largest of the three shares counts. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import robust

# The signals a shift is read from, numbered in this order by `Shift.signal`: the forward
# pass's time, a pipeline stage's own time outside its schedule (`outside_shift`) and in its
# backward passes (`backward_shift`).
SIGNALS = ("forward", "outside", "backward")
OUTSIDE, BACKWARD = SIGNALS.index("outside"), SIGNALS.index("backward")


@dataclass(kw_only=True)
class Shift:
    """Per [step, rank]: flags, the shift as a share of the step's median step time, and the
    signal it is (an index into `SIGNALS`: the largest share's)."""

    flags: robust.BoolArray
    share: robust.FloatArray
    signal: npt.NDArray[np.int8]

    @property
    def outside(self) -> robust.BoolArray:
        return is_signal(self.signal, OUTSIDE)

    @property
    def backward(self) -> robust.BoolArray:
        return is_signal(self.signal, BACKWARD)


def is_signal(signal: npt.NDArray[np.int8], index: int) -> robust.BoolArray:
    """Where `signal` (indices into `SIGNALS`) is `SIGNALS[index]`."""
    out: robust.BoolArray = np.equal(signal, index)
    return out


def history_rows(cfg: config_mod.StragglerConfig) -> int:
    """Rows before a step that its shift reads."""
    return 4 * cfg.smooth_steps - 1


def signal(a: arrays_mod.StepArrays) -> tuple[robust.FloatArray, bool] | None:
    """The forward time compared, and whether it is per token (where tokens vary); None
    where none is known."""
    forward = a.forward_s
    if forward is None or not bool((forward > 0).any()):
        return None
    x = np.where(forward > 0, forward, np.float32(np.nan))
    finite = a.tokens[np.isfinite(a.tokens) & (a.tokens > 0)]
    per_token = bool(finite.size) and float(finite.max()) > float(finite.min())
    if per_token:
        with np.errstate(all="ignore"):
            x = x / np.where(a.tokens > 0, a.tokens, np.nan)
    return x.astype(np.float32), per_token


def levels(
    x: robust.FloatArray, cfg: config_mod.StragglerConfig, current: robust.FloatArray | None = None
) -> robust.FloatArray:
    """[steps, ranks]: each rank's earlier level, before its last `smooth_steps` steps: the
    median of its levels (`current`: the trimmed mean of `smooth_steps` steps) `smooth_steps`,
    2x and 3x `smooth_steps` steps before (at a job's start, of those it has; NaN with none).
    A median of three: a shift that began within the last `2 x smooth_steps` steps moves
    one of them only."""
    if current is None:
        current = robust.rolling_trimmed_mean(x, cfg.smooth_steps)
    lag = cfg.smooth_steps
    earlier = [np.full(x.shape, np.nan, dtype=np.float32) for _ in range(3)]
    for k, out in enumerate(earlier, start=1):
        if x.shape[0] > k * lag:
            out[k * lag :] = current[: -k * lag]
    newest, middle, oldest = earlier
    low, high = np.fmin(newest, middle), np.fmax(newest, middle)
    # NaN-aware: of two known levels the higher (a smaller shift), of one that one.
    return np.fmax(low, np.fmin(high, oldest))


def shift(
    a: arrays_mod.StepArrays, step_time: robust.FloatArray, cfg: config_mod.StragglerConfig
) -> Shift | None:
    """Every rank's forward shift over the rows of `a` (`step_time`: each row's median smoothed
    step time, [steps, 1]); None where no forward time is known or fewer than 2 ranks."""
    compared = signal(a)
    if compared is None or a.num_ranks < 2:
        return None
    x, per_token = compared
    wait = a.comm_wait_s
    cpu_wait = forward_cpu_wait(a)
    if cpu_wait is not None:  # ... and a thread that waits for a CPU in its forward pass
        wait = (wait + cpu_wait).astype(np.float32)
    if per_token:
        with np.errstate(all="ignore"):
            wait = (wait / np.where(a.tokens > 0, a.tokens, np.nan)).astype(np.float32)
    with np.errstate(all="ignore"):
        # A forward pass that waits (a pipeline's receive, FSDP's all-gathers) grows when its
        # rank waits longer for a peer, or for a CPU another process holds: as much of its
        # growth as its waits' is not its own (they may have grown elsewhere: only up to the
        # forward's own growth).
        grown = _change(x, cfg)
        waited = np.nan_to_num(np.fmax(_change(wait, cfg), 0.0))
        change = grown - np.minimum(waited, np.fmax(grown, 0.0))
        net = change - robust.others_median(change)
        if per_token:  # back to seconds, at the step's median tokens
            net = net * robust.nanmedian(a.tokens, 1, keepdims=True)
    with np.errstate(invalid="ignore"):
        shares = [net / step_time]
        for other in (outside_shift(a, cfg), backward_shift(a, cfg)):
            shares.append(np.full_like(shares[0], np.nan) if other is None else other / step_time)
        stacked = np.stack(shares)  # in SIGNALS order
        # The largest share (ties: the first signal's), NaN where none is known.
        which = np.argmax(np.nan_to_num(stacked, nan=-np.inf), axis=0)
        share = np.take_along_axis(stacked, which[None], axis=0)[0]
        return Shift(flags=share >= cfg.min_shift, share=share, signal=which.astype(np.int8))


def outside_shift(
    a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig
) -> robust.FloatArray | None:
    """[steps, ranks]: each pipeline stage's change in its own time outside its schedule
    (`StepArrays.pipeline_own_s`: its step less the schedule, its data time and its waits
    outside), less the median change of the other stages, in seconds; None where no schedule
    was timed. A stage slowed outside its schedule (after its optimizer step, in its own code
    between steps) starts its next schedule late: its peers wait for it inside theirs, where
    none of them count, and its forward time does not grow. Its waits are measured, not
    attributed, so none of their growth is taken out (as for the forward pass) and no rank's
    noisy waits for its peers enter it. A shift within `outside_noise_ratio` times the stage's
    usual step-to-step change there (jitter outside the schedule) reads as no growth (0, or its
    fall where it fell)."""
    return _own_shift(a.pipeline_own_s, cfg.outside_noise_ratio, cfg)


def backward_shift(
    a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig
) -> robust.FloatArray | None:
    """[steps, ranks]: each pipeline stage's change in its own time in its backward passes
    (`StepArrays.stage_backward_own_s`: their time less its waits for a CPU and in collectives
    there), less the median change of the other stages, in seconds, with the noise test of
    `outside_shift` at `backward_noise_ratio`; None where none was timed. A stage slowed in
    its backward passes (a slow layer) makes its peers wait for it inside their schedules,
    where its own time outside and its forward time do not grow; the schedule receives a
    chunk's gradients before the chunk's backward runs, so this time holds none of its waits
    for its peers. On the real
    1F1B jobs of the fault matrix it moved by 0.4 ms at most on clean stages (of ~5 ms), and
    by the whole delay on the slowed one."""
    return _own_shift(a.stage_backward_own_s, cfg.backward_noise_ratio, cfg)


def _own_shift(
    own: robust.FloatArray | None, noise_ratio: float, cfg: config_mod.StragglerConfig
) -> robust.FloatArray | None:
    """A stage's change in `own`, a time of its own that the SDK measured, less the other
    stages' median change; 0 (or its fall) where within `noise_ratio` times the stage's usual
    step-to-step change of it; None where nothing is known."""
    if own is None or not bool(np.isfinite(own).any()):
        return None
    change = _change(own, cfg)
    with np.errstate(all="ignore"):
        net = change - robust.others_median(change)
        # Its usual step-to-step change there (the trimmed mean of |x[t] - x[t-1]|, which
        # leaves a shift's one large step out): the larger of its level now and before the
        # current window (jitter that began within it, for every stage at once, is noise too).
        moved = np.full(own.shape, np.nan, dtype=np.float32)
        moved[1:] = np.abs(np.diff(own, axis=0))
        now = robust.rolling_trimmed_mean(moved, cfg.smooth_steps)
        usual = np.fmax(levels(moved, cfg, now), now)
        quiet = net >= noise_ratio * np.nan_to_num(usual, nan=np.inf)
        return np.where(quiet, net, np.fmin(net, 0.0)).astype(np.float64)


def forward_cpu_wait(a: arrays_mod.StepArrays) -> robust.FloatArray | None:
    """[steps, ranks]: each rank's wait for a CPU inside its forward passes, where its SDK
    measured it (`StepRecord.forward_cpu_wait_s` > 0), else its whole step's wait (an older
    SDK, a forward timed by a span: all of it may have fallen inside the forward pass); None
    where no CPU wait is known."""
    if a.cpu_wait_s is None:
        return None
    step = np.nan_to_num(a.cpu_wait_s)
    if a.forward_cpu_wait_s is None:
        return step
    forward = np.nan_to_num(a.forward_cpu_wait_s)
    return np.where(forward > 0, forward, step).astype(np.float32)


def _change(x: robust.FloatArray, cfg: config_mod.StragglerConfig) -> robust.FloatArray:
    """[steps, ranks]: each rank's current level (trimmed mean of its last `smooth_steps`)
    less its earlier one (`levels`)."""
    current = robust.rolling_trimmed_mean(x, cfg.smooth_steps)
    return (current - levels(x, cfg, current)).astype(np.float64)
