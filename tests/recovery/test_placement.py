"""Placements: ranks over simulated nodes, migration to spares and resizing (pure)."""

from __future__ import annotations

import pytest

from vigil.recovery.placement import Placement


def test_build_spreads_ranks_contiguously() -> None:
    p = Placement.build(nproc=8, nodes=4, spare=2)
    assert p.active == ("node-0", "node-1", "node-2", "node-3")
    assert p.spares == ("node-4", "node-5")
    assert [p.node_of(r) for r in range(8)] == [f"node-{r // 2}" for r in range(8)]
    assert p.ranks_on("node-2") == [4, 5] and p.ranks_on("node-5") == []
    assert p.nodes_of([1, 2, 3, 99]) == ["node-0", "node-1"]


def test_migrate_keeps_rank_order_and_cordons() -> None:
    p = Placement.build(nproc=4, nodes=2, spare=1).migrate(["node-0"])
    assert p.active == ("node-2", "node-1") and p.spares == ()
    assert p.node_of(0) == "node-2" and p.world_size == 4
    assert "node-0" in p.cordoned
    with pytest.raises(ValueError, match="only 0 spare"):
        p.migrate(["node-1"])


def test_resize_shrinks_world() -> None:
    p = Placement.build(nproc=6, nodes=3).resize(["node-1"])
    assert p.active == ("node-0", "node-2") and p.world_size == 4
    with pytest.raises(ValueError, match="no active node would remain"):
        p.resize(["node-0", "node-2"])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nproc": 5, "nodes": 2}, "multiple of --nodes"),
        ({"nproc": 0}, "nproc >= 1"),
        ({"nproc": 2, "spare": -1}, "spare >= 0"),
    ],
)
def test_bad_layouts_say_what_to_change(kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Placement.build(**kwargs)


def test_rank_outside_world_is_refused() -> None:
    with pytest.raises(ValueError, match="outside world size 2"):
        Placement.build(nproc=2).node_of(2)
