"""How findings name process groups (analyzer/groups.py): labels, nodes and rank spans."""

from __future__ import annotations

import numpy as np
import pytest

from vigil import schema
from vigil.analyzer import groups


@pytest.mark.parametrize(
    ("name", "ranks", "nodes", "text"),
    [
        ("tp:7", [4, 5, 6, 7], ["node-3"] * 4, "the tp group of node-3 (ranks 4-7)"),
        ("dp:9", [1, 3], ["node-0", "node-1"], "the dp group across node-0, node-1 (ranks 1, 3)"),
        ("dp_cp:12", [0, 1, 2, 3, 8, 9, 10, 11], [], "the dp_cp group (ranks 0-3, 8-11)"),
        ("mesh_tp:5", [0, 1], ["a", "a"], "the tp group of a (ranks 0, 1)"),  # older records
        ("pg:3", [0, 2], [], "process group 3 (ranks 0, 2)"),
        ("world", [0, 1, 2], [], "the world group (ranks 0-2)"),
        ("pp:24:p2p:0-2", [0, 2], [], "the pp pair 0<->2"),
        ("world:p2p:1-2", [1, 2], ["n1", "n2"], "the world pair 1<->2 across n1, n2"),
        ("dp", [6], [], "the dp group (ranks 6)"),  # simulated jobs: a bare label
    ],
)
def test_a_group_reads_as_its_dimension_nodes_and_ranks(
    name: str, ranks: list[int], nodes: list[str], text: str
) -> None:
    assert groups.describe(name, ranks, nodes) == text


def test_many_nodes_are_counted_not_listed() -> None:
    nodes = [f"node-{i}" for i in range(6)]
    assert groups.describe("dp:1", [0, 8, 16, 24, 32, 40], nodes) == (
        "the dp group across node-0, node-1, node-2, node-3 and 2 more (ranks 0, 8, 16, 24, 32, 40)"
    )


def test_a_straggler_holds_up_its_labelled_groups_smallest_first() -> None:
    keys = [
        ("world", "all_reduce"), ("tp:3", "all_reduce"), ("dp:5", "all_reduce"),
        ("tp:3:p2p:2-3", "p2p"), ("dp_tp:8", "all_reduce"), ("dp:5", "reduce_scatter"),
    ]  # fmt: skip
    # (key index, column) of each aggregate, as StepArrays.aggs holds them, two steps' worth: 4
    # ranks in world and dp_tp, tp {2, 3}, dp {1, 3}, a p2p pair {2, 3}.
    rows = [(0, c) for c in range(4)] + [(1, 2), (1, 3), (2, 1), (2, 3), (3, 2), (3, 3)]
    rows += [(4, c) for c in range(4)] + [(5, 1), (5, 3)]  # dp's second op class: one group
    key, col = (np.array([r[i] for r in rows * 2], dtype=np.int64) for i in (0, 1))
    assert groups.held_up(keys, key, col, 3) == [
        ("dp:5", [1, 3]),
        ("tp:3", [2, 3]),
        ("dp_tp:8", [0, 1, 2, 3]),
    ]  # no world, no pair; the smallest groups first
    assert groups.held_up(keys, key, col, 3, limit=1) == [("dp:5", [1, 3])]
    assert groups.held_up(keys, key, col, 0) == [("dp_tp:8", [0, 1, 2, 3])]


def test_a_hang_names_the_group_it_stopped_in_by_label_and_ranks() -> None:
    from vigil.analyzer import config as config_mod
    from vigil.analyzer import hangs

    tracker = hangs.HangTracker("job", config_mod.HangConfig())
    for step in range(20):
        tracker.observe_step_time(step, 100.0 + step * 0.25, 0.25)
    # dp x tp: rank 3 never entered all-reduce #31 of its tp group, which rank 2 waits in.
    for rank, seq in ((0, 31), (1, 31), (2, 31), (3, 30)):
        tracker.observe_seq(rank, f"tp:{11 + rank // 2}", seq, "all_reduce")
    tracker.observe_position(2, "tp:12", 31, "all_reduce", schema.RankState.IN_COLLECTIVE)
    finding = tracker.check(130.0)
    assert finding is not None and finding.subjects.ranks == [3]
    assert "never entered all_reduce #31 of group 'tp:12', the tp group (ranks 2, 3), that" in (
        finding.summary
    )
