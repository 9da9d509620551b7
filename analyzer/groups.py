"""Process groups as people name them: "the tp group of node-3 (ranks 4-7)".

The SDK names a collective's group `<label>:<id>` (agent/groups.py): the label is the parallel
dimension (`tp`, `dp`, `dp_cp`, Megatron's `mp`, a user's own), the id tells groups of one
label apart; `world` is the default group, `pg:<id>` an unlabelled one, and point-to-point
pairs add `:p2p:<low>-<high>`. Older records named DeviceMesh groups `mesh_<dim>:<id>`; they
read the same. Names without a colon (simulated jobs, Flight Recorder dumps) are their own
label. Pure: string work over names, ranks and nodes, numpy over aggregate columns; detectors
call it for their summaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_UNLABELLED = "pg"
_MESH_PREFIX = "mesh_"


@dataclass(frozen=True, kw_only=True)
class GroupName:
    """A wire group name taken apart: `label`, the group's `ident` (may be empty) and, for a
    point-to-point pair, its `pair` of global ranks."""

    label: str
    ident: str = ""
    pair: tuple[int, int] | None = None

    @property
    def labelled(self) -> bool:
        return self.label != _UNLABELLED


def parse(name: str) -> GroupName:
    head, pair = name, None
    base, sep, peers = name.rpartition(":p2p:")
    if sep:
        low, dash, high = peers.partition("-")
        if dash and low.isdigit() and high.isdigit():
            head, pair = base, (int(low), int(high))
    label, colon, ident = head.partition(":")
    if label.startswith(_MESH_PREFIX) and colon:
        label = label[len(_MESH_PREFIX) :]
    return GroupName(label=label or _UNLABELLED, ident=ident, pair=pair)


def label(name: str) -> str:
    """The parallel dimension a group name stands for (`tp:7` -> `tp`)."""
    return parse(name).label


def rank_span(ranks: Iterable[int]) -> str:
    """`4-7`, `1, 3, 5, 7`, `0-3, 8-11`: runs of consecutive ranks folded."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ", ".join(parts)


def describe(name: str, ranks: Sequence[int] = (), nodes: Sequence[str] = ()) -> str:
    """`the tp group of node-3 (ranks 4-7)`; `the dp group across node-0, node-1 (ranks 1, 3)`;
    `the pp pair 0<->2`; `the world group (ranks 0-7)`; `process group 7 (ranks 0, 1)` for an
    unlabelled one. `nodes`: the members' nodes, any order, repeats allowed."""
    g = parse(name)
    where = _where(nodes)
    if g.pair is not None:
        kind = f"the {g.label} pair" if g.labelled else "the pair"
        return f"{kind} {g.pair[0]}<->{g.pair[1]}{where}"
    who = f" (ranks {rank_span(ranks)})" if ranks else ""
    if not g.labelled:
        return f"process group {g.ident or name}{where}{who}"
    return f"the {g.label} group{where}{who}"


def _where(nodes: Sequence[str]) -> str:
    distinct = sorted({n for n in nodes if n})
    if not distinct:
        return ""
    if len(distinct) == 1:
        return f" of {distinct[0]}"
    shown = ", ".join(distinct[:4]) + (
        f" and {len(distinct) - 4} more" if len(distinct) > 4 else ""
    )
    return f" across {shown}"


def held_up(
    agg_keys: Sequence[tuple[str, str]], keys: npt.NDArray[np.int64], cols: npt.NDArray[np.int64],
    col: int, *, limit: int = 3,
) -> list[tuple[str, list[int]]]:  # fmt: skip
    """The labelled groups (not `world`, not point-to-point pairs, more than one member) that
    column `col` reported ops in, smallest first, at most `limit`, each with its member columns
    (the columns that reported it): what a straggler in `col` holds up. `keys` and `cols` are
    aggregate columns (`StepArrays.aggs`); vectorised, so a 10,000-rank window costs a few
    array passes per finding."""
    by_name: dict[str, list[int]] = {}  # a group's op classes (gathers, reductions) are one
    for key in np.unique(keys[cols == col]).tolist():
        name = agg_keys[key][0]
        if _judged(parse(name)):
            by_name.setdefault(name, []).append(key)
    found = []
    for name, ids in by_name.items():
        members = np.unique(cols[np.isin(keys, ids)]).tolist()
        if len(members) > 1:
            found.append((len(members), name, members))
    found.sort()
    return [(name, members) for _, name, members in found[:limit]]


def _judged(g: GroupName) -> bool:
    return g.pair is None and g.labelled and g.label != "world"
