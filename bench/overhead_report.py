"""The figures `bench/sdk_overhead.py` prints: per-workload step-time tables, the in-place CPU
figures, the targets' verdicts and the last JSON line, with bootstrap 90 % intervals.

Pure arithmetic and printing over what rank 0 measured; nothing here runs a model.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Protocol

import numpy as np

# The step kinds measured side by side in each round, in the order the tables show them:
# "plain_again" is a second bare run, the A/A control of the machine's noise.
MODES = ("plain", "sdk", "profiler", "ddp_hook", "plain_again")
# Step kinds of the in-place CPU measurement, each with a model of its own (so each model's
# state is as cold in the caches as the others'): "plain" and "plain_b" are bare DDP models,
# "sdk" is watched by the SDK, "profiler" is a bare one run under torch.profiler, "ddp_hook" has
# torch's own default comm hook alone (dividing each bucket on the training thread).
CPU_KINDS = ("plain", "plain_b", "sdk", "profiler", "ddp_hook")


class Workload(Protocol):
    """What the report reads of a workload (`sdk_overhead.Workload`)."""

    name: str


def workload_report(
    w: Workload,
    times: dict[tuple[str, str], list[float]],
    cpu: dict[tuple[str, str], list[float]],
    rounds: list[dict[tuple[str, str], float]],
    world: int,
) -> dict[str, Any]:
    """Print one workload's table; its figures for the JSON line (unsuffixed keys)."""
    t = {mode: times[w.name, mode] for mode in MODES}
    med = {mode: statistics.median(v) for mode, v in t.items()}
    cpu_med = {mode: statistics.median(cpu[w.name, mode]) for mode in MODES}
    ratio = {mode: med[mode] / med["plain"] for mode in MODES}
    interval = {mode: _interval(t[mode], t["plain"]) for mode in MODES}
    print(f"\nworkload {w}: {world} ranks (gloo, CPU), {len(t['plain'])} measured steps per mode")
    print(
        f"{'mode':<12}{'median step ms':>15}{'ratio':>8}{'90% interval':>18}"
        f"{'thread CPU ms':>15}{'ratio':>8}"
    )
    for mode in MODES:
        low, high = interval[mode]
        print(
            f"{mode:<12}{med[mode] * 1e3:>15.2f}{ratio[mode]:>8.4f}"
            f"{f'{low:.4f}-{high:.4f}':>18}"
            f"{cpu_med[mode] * 1e3:>15.2f}{cpu_med[mode] / cpu_med['plain']:>8.4f}"
        )
    if ratio["sdk"] > 1.0 and ratio["profiler"] > 1.0:
        print(
            "profiler overhead / SDK overhead: "
            f"{(ratio['profiler'] - 1.0) / (ratio['sdk'] - 1.0):.1f}x"
        )
    else:
        print("profiler overhead / SDK overhead: n/a (SDK overhead below the noise)")
    paired = {
        mode: statistics.median(r[w.name, mode] / r[w.name, "plain"] for r in rounds)
        for mode in MODES[1:]
    }
    print(
        f"paired per-round wall ratios (drift-cancelling cross-check, {len(rounds)} rounds): "
        + ", ".join(f"{mode} {paired[mode]:.4f}" for mode in MODES[1:])
    )
    return {
        "sdk_overhead_ratio": round(ratio["sdk"], 4),
        "sdk_overhead_ratio_90": [round(v, 4) for v in interval["sdk"]],
        "profiler_overhead_ratio": round(ratio["profiler"], 4),
        "ddp_comm_hook_ratio": round(ratio["ddp_hook"], 4),
        "aa_ratio": round(ratio["plain_again"], 4),
        "aa_ratio_90": [round(v, 4) for v in interval["plain_again"]],
        "plain_step_ms": round(med["plain"] * 1e3, 1),
    }


def cpu_report(w: Workload, step_cpu: dict[str, Any], cycles: int) -> dict[str, Any]:
    """Print the in-place CPU figures; theirs for the JSON line."""
    own = {kind: np.asarray(v) for kind, v in step_cpu["own"].items()}
    other = {kind: np.asarray(v) for kind, v in step_cpu["other"].items()}
    # Bootstrap draws of whole sets of models (each cycle's set: step_cpu["sets"]), made once
    # and shared by every interval below.
    draws = _set_draws(np.asarray(step_cpu["sets"]))
    base = (own["plain"] + own["plain_b"]) / 2  # per cycle: the two bare steps' mean
    sdk_d, prof_d = own["sdk"] - base, own["profiler"] - base
    floor_d = own["ddp_hook"] - base
    aa_d = own["plain_b"] - own["plain"]
    sdk_us, sdk_90 = _median_interval(sdk_d, draws)
    prof_us, prof_90 = _median_interval(prof_d, draws)
    aa_us, aa_90 = _median_interval(aa_d, draws)
    share_90 = _share_interval(sdk_d, prof_d, draws)
    share = sdk_us / prof_us if prof_us > 0 else float("nan")
    floor_us, floor_90 = _median_interval(floor_d, draws)
    beyond_us, beyond_90 = _median_interval(sdk_d - floor_d, draws)
    beyond_share = beyond_us / prof_us if prof_us > 0 else float("nan")
    other_base = (other["plain"] + other["plain_b"]) / 2
    sdk_other_us, _ = _median_interval(other["sdk"] - other_base, draws)
    prof_other_us, _ = _median_interval(other["profiler"] - other_base, draws)
    background_us = step_cpu["sdk_threads_s"] * 1e6
    stop_us = step_cpu["stop_s"] * 1e6
    sdk_all_us = sdk_us + sdk_other_us + background_us
    prof_all_us = prof_us + prof_other_us + stop_us
    all_share = sdk_all_us / prof_all_us if prof_all_us > 0 else float("nan")
    plain_ms = float(np.median(base)) * 1e3
    print(
        f"\ntraining-thread CPU per step, in place (rank 0 alone, workload {w.name}, {cycles} "
        f"cycles of {len(CPU_KINDS)} steps in shuffled order; a bare step: {plain_ms:.2f} ms of "
        "CPU); "
        "medians over cycles beyond the cycle's two bare steps (DDP without a comm hook):"
    )
    print(
        f"  SDK (step + phase hooks + its DDP comm hook): {sdk_us:.0f} us "
        f"(90% interval {sdk_90[0]:.0f}-{sdk_90[1]:.0f})"
    )
    print(
        f"  torch.profiler (default activities) over the step: {prof_us:.0f} us "
        f"(90% interval {prof_90[0]:.0f}-{prof_90[1]:.0f})"
    )
    print(
        f"  SDK / profiler: {share:.3f} (90% interval {share_90[0]:.3f}-{share_90[1]:.3f}); "
        "target <= 0.10"
    )
    print(
        f"  torch's default DDP comm hook alone (DDP's C++ path folds the averaging into its "
        f"gradient copy; this hook divides the bucket on the training thread, in a pass of its "
        f"own, where the SDK's divides it on gloo's thread): {floor_us:.0f} us (90% interval "
        f"{floor_90[0]:.0f}-{floor_90[1]:.0f}); "
        f"the SDK less that hook: {beyond_us:.0f} us (90% interval {beyond_90[0]:.0f}-"
        f"{beyond_90[1]:.0f}), {beyond_share:.3f} of the profiler's"
    )
    print(
        f"  A/A, bare model B less bare model A: {aa_us:.0f} us "
        f"(90% interval {aa_90[0]:.0f}-{aa_90[1]:.0f}): the method's own noise"
    )
    print(
        f"  not in those figures: the SDK on other threads, {sdk_other_us:.0f} us per step (its "
        f"comm hook's completion callbacks and their division of each summed bucket, run on "
        f"gloo's threads), and its flusher thread, "
        f"{background_us:.0f} us per SDK step at this step rate; the profiler on other threads, "
        f"{prof_other_us:.0f} us per step, and its stop (collecting the step's events, on the "
        f"training thread), {stop_us:.0f} us per profiled step"
    )
    print(
        f"  all threads together: the SDK {sdk_all_us:.0f} us per step, the profiler "
        f"{prof_all_us:.0f} us per step (its stop counted whole: a schedule spreads it over its "
        f"active steps); {all_share:.3f}"
    )
    return {
        "sdk_step_cpu_us": round(sdk_us, 1),
        "sdk_step_cpu_us_90": [round(v, 1) for v in sdk_90],
        "profiler_step_cpu_us": round(prof_us, 1),
        "profiler_step_cpu_us_90": [round(v, 1) for v in prof_90],
        "sdk_cpu_share_of_profiler": round(share, 4),
        "sdk_cpu_share_of_profiler_90": [round(v, 4) for v in share_90],
        "hook_floor_step_cpu_us": round(floor_us, 1),
        "hook_floor_step_cpu_us_90": [round(v, 1) for v in floor_90],
        "sdk_beyond_floor_cpu_us": round(beyond_us, 1),
        "sdk_beyond_floor_cpu_us_90": [round(v, 1) for v in beyond_90],
        "sdk_beyond_floor_share_of_profiler": round(beyond_share, 4),
        "cpu_aa_us": round(aa_us, 1),
        "sdk_other_threads_cpu_us": round(sdk_other_us, 1),
        "sdk_background_cpu_us": round(background_us, 1),
        "profiler_other_threads_cpu_us": round(prof_other_us, 1),
        "profiler_stop_cpu_us": round(stop_us, 1),
        "sdk_all_threads_cpu_us": round(sdk_all_us, 1),
        "profiler_all_threads_cpu_us": round(prof_all_us, 1),
        "sdk_all_threads_share_of_profiler": round(all_share, 4),
    }


def report(
    args: argparse.Namespace,
    times: dict[tuple[str, str], list[float]],
    cpu: dict[tuple[str, str], list[float]],
    rounds: list[dict[tuple[str, str], float]],
    hook_us: float,
    step_cpu: dict[str, Any],
    cpu_workload: Workload,
    sdk_pct: float | None,
    world: int,
) -> None:
    result: dict[str, Any] = {}
    workloads: list[Workload] = args.workload
    for k, w in enumerate(workloads if rounds else []):  # --rounds 0: the CPU figures only
        figures = workload_report(w, times, cpu, rounds, world)
        result.update(
            figures if k == 0 else {_suffixed(key, w.name): v for key, v in figures.items()}
        )
    print(f"\nper-collective hook cost: {hook_us:.2f} us")
    cpu_figures = cpu_report(cpu_workload, step_cpu, args.cpu_cycles)
    share = cpu_figures["sdk_cpu_share_of_profiler"]
    targets = [
        f"SDK CPU share of the profiler's {share:.3f} <= 0.10: "
        + _verdict(share, cpu_figures["sdk_cpu_share_of_profiler_90"], 0.10)
    ]
    if rounds:
        ratio, aa = result["sdk_overhead_ratio"], result["aa_ratio"]
        verdict = _verdict(ratio, result["sdk_overhead_ratio_90"], 1.01)
        if abs(aa - 1.0) > 0.01:
            verdict += f"; a noisy run: the A/A control is {aa:.4f}"
        targets.insert(0, f"step-time ratio of {workloads[0].name} {ratio:.4f} <= 1.01: {verdict}")
    print("\ntargets: " + "; ".join(targets))
    result["hook_cost_us"] = round(hook_us, 2)
    result.update(cpu_figures)
    result["sdk_thread_pct"] = None if sdk_pct is None else round(sdk_pct, 3)
    result["world"] = world
    result["rounds"] = args.rounds
    print(json.dumps(result))


def _suffixed(key: str, name: str) -> str:
    """`key` of workload `name`: sdk_overhead_ratio_40ms, sdk_overhead_ratio_40ms_90."""
    base, interval = (key[:-3], "_90") if key.endswith("_90") else (key, "")
    return f"{base}_{name}{interval}"


def _verdict(value: float, interval: list[float], target: float) -> str:
    """Whether `value` (with its 90 % interval) is at most `target`, and how surely."""
    low, high = interval
    if high <= target:
        return f"met (90% interval {low:.4g}-{high:.4g})"
    if low > target:
        return f"not met (90% interval {low:.4g}-{high:.4g})"
    how = "met" if value <= target else "not met"
    return f"{how} by the median, not resolved (90% interval {low:.4g}-{high:.4g})"


def _interval(with_: list[float], without: list[float], draws: int = 2000) -> tuple[float, float]:
    """Bootstrap 90 % interval of median(with_) / median(without), steps resampled."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(with_), np.asarray(without)
    ratios = np.median(rng.choice(a, (draws, a.size)), axis=1) / np.median(
        rng.choice(b, (draws, b.size)), axis=1
    )
    low, high = np.percentile(ratios, [5, 95])
    return float(low), float(high)


def _median_interval(
    seconds: np.ndarray, draws: list[np.ndarray]
) -> tuple[float, tuple[float, float]]:
    """The median of per-cycle differences, in microseconds, and its 90 % interval over
    `draws` (`_set_draws`: whole sets of models, their cycles together; a set's models keep
    their own cost for as long as they live, so cycles of one set are not independent)."""
    us = seconds * 1e6
    medians = [np.median(us[pick]) for pick in draws]
    low, high = np.percentile(medians, [5, 95])
    return float(np.median(us)), (float(low), float(high))


def _share_interval(
    sdk: np.ndarray, prof: np.ndarray, draws: list[np.ndarray]
) -> tuple[float, float]:
    """Bootstrap 90 % interval of median(sdk) / median(prof) over `draws` (`_set_draws`)."""
    shares = [np.median(sdk[pick]) / np.median(prof[pick]) for pick in draws]
    low, high = np.percentile(shares, [5, 95])
    return float(low), float(high)


def _set_draws(sets: np.ndarray, draws: int = 2000) -> list[np.ndarray]:
    """`draws` bootstrap samples of cycle indices (`sets`: each cycle's set of models): as
    many sets as there are, drawn with replacement, each with all its cycles."""
    rng = np.random.default_rng(0)
    ids = np.unique(sets)
    members = [np.flatnonzero(sets == i) for i in ids]
    return [
        np.concatenate([members[j] for j in rng.integers(0, ids.size, ids.size)])
        for _ in range(draws)
    ]
