"""Where each rank runs: active nodes, spares, and the moves recovery makes (pure).

A placement assigns ranks contiguously to active nodes (`ranks_per_node` each), like torchrun's
`--nnodes/--nproc-per-node`. `migrate` swaps a bad node for a spare; `resize` drops nodes and so
shrinks the world (the data-parallel size) by their ranks. No processes, no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Placement:
    active: tuple[str, ...]
    spares: tuple[str, ...] = ()
    ranks_per_node: int
    cordoned: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not self.active:
            raise ValueError("a placement needs at least one active node")
        if self.ranks_per_node < 1:
            raise ValueError("ranks_per_node must be >= 1")
        names = list(self.active) + list(self.spares)
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique: {names}")

    @classmethod
    def build(cls, *, nproc: int, nodes: int = 1, spare: int = 0) -> Placement:
        """`nproc` ranks over `nodes` simulated nodes named node-0.., plus `spare` spares."""
        if nproc < 1 or nodes < 1 or spare < 0:
            raise ValueError("need nproc >= 1, nodes >= 1 and spare >= 0")
        if nproc % nodes:
            raise ValueError(
                f"--nproc {nproc} must be a multiple of --nodes {nodes} "
                "(each simulated node runs the same number of ranks)"
            )
        names = tuple(f"node-{i}" for i in range(nodes + spare))
        return cls(active=names[:nodes], spares=names[nodes:], ranks_per_node=nproc // nodes)

    @property
    def world_size(self) -> int:
        return len(self.active) * self.ranks_per_node

    def node_of(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return self.active[rank // self.ranks_per_node]

    def ranks_on(self, node: str) -> list[int]:
        if node not in self.active:
            return []
        i = self.active.index(node)
        return list(range(i * self.ranks_per_node, (i + 1) * self.ranks_per_node))

    def nodes_of(self, ranks: Iterable[int]) -> list[str]:
        return sorted({self.node_of(r) for r in ranks if 0 <= r < self.world_size})

    def migrate(self, bad: Sequence[str]) -> Placement:
        """Replace each bad active node by a spare, keeping rank order; bad nodes are cordoned."""
        bad = [n for n in dict.fromkeys(bad) if n in self.active]
        if len(bad) > len(self.spares):
            raise ValueError(f"cannot migrate {bad}: only {len(self.spares)} spare node(s) left")
        spares = list(self.spares)
        mapping = {n: spares.pop(0) for n in bad}
        return Placement(
            active=tuple(mapping.get(n, n) for n in self.active),
            spares=tuple(spares),
            ranks_per_node=self.ranks_per_node,
            cordoned=self.cordoned | frozenset(bad),
        )

    def cordon(self, node: str) -> Placement:
        """Mark `node` as never to be used again: a spare leaves the spares; an active node
        keeps its ranks until the next restart moves them (`avoid_cordoned`)."""
        return Placement(
            active=self.active,
            spares=tuple(n for n in self.spares if n != node),
            ranks_per_node=self.ranks_per_node,
            cordoned=self.cordoned | {node},
        )

    def avoid_cordoned(self) -> Placement:
        """This placement with no cordoned active node: each is swapped for a spare while spares
        last, the rest dropped (the world shrinks). ValueError when no active node would remain."""
        bad = [n for n in self.active if n in self.cordoned]
        if not bad:
            return self
        swapped = min(len(bad), len(self.spares))
        moved = self.migrate(bad[:swapped]) if swapped else self
        return moved.resize(bad[swapped:]) if bad[swapped:] else moved

    def resize(self, bad: Sequence[str]) -> Placement:
        """Drop bad nodes (cordoned); the world shrinks by their ranks."""
        bad_set = {n for n in bad if n in self.active}
        remaining = tuple(n for n in self.active if n not in bad_set)
        if not remaining:
            raise ValueError(f"cannot resize away {sorted(bad_set)}: no active node would remain")
        return Placement(
            active=remaining,
            spares=self.spares,
            ranks_per_node=self.ranks_per_node,
            cordoned=self.cordoned | frozenset(bad_set),
        )
