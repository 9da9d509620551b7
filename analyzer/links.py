"""Slow links from collective groups: a group whose ops move the same bytes as its peer groups'
but take much longer, step after step.

A link's slowness is shared by everyone whose traffic crosses it, so it shows in the transfer
time of the process groups that use it (attribution.py: the shortest member's duration, with
nobody waited for), not in one rank's numbers. Groups of one kind (the same name before the
last `:id`, e.g. the `dp` groups of a 2-D mesh, and the same op class and bytes per op) are
compared each step: a group whose transfer is `link_ratio` x the median of the others, and
longer by at least `min_excess` of the step, is flagged; `min_hits` of `window` steps make a
finding, and the episode's median ratio must itself reach the bar (a group slow in a third of
its steps under a passing load is not a slow link, and a link is never reported faster than its
peers). A group whose members all sit on one host moves its bytes through shared memory or
loopback, not a network link: its transfer time is CPU work that competing processes inflate
(clean 4-rank jobs on one host under a CPU hog, 9 runs: per-group median ratios up to 1.55x,
single steps up to ~5x, up to 15 of 30 steps past 1.5x; a real tbf-limited link: 5-6x in every
step), so it must be `INTRA_HOST_RATIO` x slower in `min_hits` of `window` steps. Its subjects
are the group's members and their nodes (`a<->b` when they span two). With a single group of
a kind (one world group) nothing can be compared, and nothing is said; point-to-point pairs are
not judged: a pipeline's send waits for its receiver's schedule, and an async op's duration
ends where the thread waits for it (judged like groups, the pairs of real 1F1B jobs read
4.5-10.6x their peers beside a slow stage and under CPU load, with no slow link).
Pure numpy over `StepArrays` that carry their aggregates.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from vigil import schema
from vigil.analyzer import arrays as arrays_mod
from vigil.analyzer import attribution, findings, robust
from vigil.analyzer import config as config_mod
from vigil.analyzer import groups as group_names

# The bar for a group whose members all run on one host (see the module docstring): twice the
# median ratio CPU contention alone produced there, below half a broken link's.
INTRA_HOST_RATIO = 3.0


def group_kind(group: str) -> str:
    """Groups compared with each other share this: the name without its last `:id`, i.e. the
    group's label (`tp:7` -> `tp`; an older `mesh_tp:7` -> `mesh_tp`)."""
    head, sep, _ = group.rpartition(":")
    return head if sep else group


def detect(a: arrays_mod.StepArrays, cfg: config_mod.StragglerConfig) -> list[schema.Finding]:
    g = a.transfers
    if g is None:
        if a.aggs is None or not len(a.aggs):
            return []
        g = attribution.group_transfer(a.aggs)
    if not g.row.size or not a.agg_keys:
        return []
    keys, first_cell, col_at = np.unique(g.key, return_index=True, return_inverse=True)
    col_of = {int(k): i for i, k in enumerate(keys)}
    transfer = np.full((a.num_steps, keys.size), np.nan)
    transfer[g.row, col_at.reshape(-1)] = g.transfer_s  # one cell per (row, key)
    # Each group's members as its first comparable cell lists them.
    members = dict(zip(keys.tolist(), g.members(first_cell.tolist()), strict=True))
    classes: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    # Each (key, bytes per op) once, in the order the cells first show it.
    order = np.lexsort((np.arange(g.key.size), g.nbytes, g.key))
    new_pair = np.ones(order.size, dtype=bool)
    new_pair[1:] = (g.key[order[1:]] != g.key[order[:-1]]) | (
        g.nbytes[order[1:]] != g.nbytes[order[:-1]]
    )
    pairs = np.sort(order[new_pair])
    for key, nbytes in zip(g.key[pairs].tolist(), g.nbytes[pairs].tolist(), strict=True):
        name, op = a.agg_keys[key]
        if op == "p2p":
            continue  # a send completes only once its receiver takes it: not a link's own time
        classes[(group_kind(name), op, nbytes)].add(key)
    with np.errstate(all="ignore"):
        step = robust.nanmedian(a.step_time_s.astype(np.float64), 1)
    flags = np.zeros(transfer.shape, dtype=bool)
    baseline = np.full(transfer.shape, np.nan)
    bar = np.full(keys.size, cfg.link_ratio)
    for key, who in members.items():
        hosts = {a.nodes[c] for c in who}
        if len(hosts) == 1 and "" not in hosts:  # one host: no network link between them
            bar[col_of[key]] = max(cfg.link_ratio, INTRA_HOST_RATIO)
    for peers in classes.values():
        if len(peers) < 2:
            continue
        cols = [col_of[k] for k in sorted(peers)]
        block = transfer[:, cols]
        for j, col in enumerate(cols):
            others = np.delete(block, j, axis=1)
            with np.errstate(all="ignore"):
                base = robust.nanmedian(others, 1)
            mine = block[:, j]
            baseline[:, col] = base
            with np.errstate(invalid="ignore"):
                flags[:, col] = (mine >= bar[col] * base) & (mine - base >= cfg.min_excess * step)
    hits = robust.rolling_hits(flags, cfg.window)
    episodes: dict[tuple[int, ...], list[tuple[int, int, int, int]]] = defaultdict(list)
    for col in np.flatnonzero((hits >= cfg.min_hits).any(axis=0)).tolist():
        for first, last, at in robust.persistent_episodes(
            flags[:, col], hits[:, col], cfg.min_hits
        ):
            rows = slice(first, last + 1)
            with np.errstate(all="ignore"):
                ratio = np.nanmedian(transfer[rows, col] / baseline[rows, col])
            if not ratio >= bar[col]:  # slow in too few of the episode's steps (or NaN)
                continue
            episodes[members[int(keys[col])]].append((col, first, last, at))
    return [_finding(a, who, eps, transfer, baseline, keys) for who, eps in episodes.items()]


def _finding(
    a: arrays_mod.StepArrays,
    who: tuple[int, ...],
    eps: list[tuple[int, int, int, int]],
    transfer: np.ndarray,
    baseline: np.ndarray,
    keys: np.ndarray,
) -> schema.Finding:
    assert a.agg_keys is not None
    first, last = min(e[1] for e in eps), max(e[2] for e in eps)
    at = min(e[3] for e in eps)
    cols = sorted({e[0] for e in eps})
    rows = slice(first, last + 1)
    with np.errstate(all="ignore"):
        observed = float(np.nansum(np.nanmedian(transfer[rows][:, cols], axis=0)))
        base = float(np.nansum(np.nanmedian(baseline[rows][:, cols], axis=0)))
    ranks = [int(a.ranks[c]) for c in who]
    nodes = sorted({a.nodes[c] for c in who if a.nodes[c]})
    links = [f"{nodes[0]}<->{nodes[1]}"] if len(nodes) == 2 else []
    where = (
        " <-> ".join(nodes) if links else ", ".join(nodes) or "ranks " + ", ".join(map(str, ranks))
    )
    names = sorted({a.agg_keys[int(keys[c])][0] for c in cols})
    member_nodes = [a.nodes[c] for c in who]
    described = ", ".join(group_names.describe(n, ranks, member_nodes) for n in names)
    ops = sorted({a.agg_keys[int(keys[c])][1] for c in cols})
    ratio = observed / base if base > 0 else float("inf")
    return findings.make_finding(
        kind=schema.FindingKind.SLOW_LINK,
        job_id=a.job_id,
        subjects=schema.Subjects(ranks=ranks, nodes=nodes, links=links),
        step_start=int(a.steps[first]),
        step_end=int(a.steps[last]),
        summary=(
            f"slow link {where}: {described} ({', '.join(ops)}) moves its bytes "
            f"{ratio:.2f}x slower than its peer groups"
        ),
        evidence=[
            findings.evidence(
                "collective_transfer_time",
                observed,
                base,
                unit="s",
                note="per step, the group's shortest member vs the median of its peer groups",
            ),
            findings.evidence("groups_affected", len(cols)),
        ],
        confidence=min(0.95, 0.5 + 0.1 * ratio),
        detected_s=float(a.step_end_s[at]) if np.isfinite(a.step_end_s[at]) else 0.0,
        trace_start_s=float(a.step_start_s[first]) if np.isfinite(a.step_start_s[first]) else 0.0,
        trace_end_s=float(a.step_end_s[last]) if np.isfinite(a.step_end_s[last]) else 0.0,
    )
