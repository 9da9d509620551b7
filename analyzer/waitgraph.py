"""The wait-for graph of a stalled job: which ranks never entered the collective others wait in.

Pure functions over positions: `seqs[group][rank]`, the last sequence number each rank entered
in each process group (from heartbeats and collective aggregates), and the ranks that say they
wait inside a collective (`Wait`). `find_culprits` follows who waits for whom to the ranks at the
ends of those chains; `behind_everywhere` names the ranks behind their peers in some group and
ahead in none, for collectives whose waits the SDK cannot see (FSDP2, DTensor); `desync` tells
the members of a group that entered different collectives at one sequence number (a rank that
left its loop early on uneven data, a rank-dependent branch). Used by `hangs.HangTracker` and
the Flight Recorder analysis; no state, no clocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Wait:
    """Where one rank waits: inside collective `seq` of `group` (op `op`)."""

    rank: int
    group: str
    seq: int
    op: str


@dataclass(frozen=True, kw_only=True)
class Culprits:
    """The ranks that never entered the collective others wait in, and that collective."""

    ranks: tuple[int, ...]
    group: str
    seq: int
    op: str
    num_waiting: int
    resolved: bool  # False when the culprits are a best guess (membership unknown)
    # A desync's collectives, the culprits' last (`Desync.variants`); empty for other stalls.
    desync: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Desync:
    """Members of `group` that entered different collectives as their `seq`-th."""

    group: str
    seq: int
    variants: tuple[tuple[str, tuple[int, ...]], ...]  # (op, ranks), the most ranks first

    @property
    def culprits(self) -> tuple[int, ...]:
        """The ranks outside the largest variant (the collective most members entered)."""
        return tuple(sorted(r for _, ranks in self.variants[1:] for r in ranks))

    @property
    def resolved(self) -> bool:
        """Whether one collective has more members than any other (else who is off is a guess)."""
        return len(self.variants[0][1]) > len(self.variants[1][1])


def desync(group: str, seq: int, ops: Mapping[int, str]) -> Desync | None:
    """The desync at `seq` of `group` (`ops`: rank -> the op it entered there), if its members
    entered different ops. In a synchronous program every member's n-th collective of a group
    is the same one (a pair's sends meeting receives are the caller's to leave out)."""
    by_op: dict[str, list[int]] = {}
    for rank, op in ops.items():
        by_op.setdefault(op, []).append(rank)
    if len(by_op) < 2:
        return None
    variants = sorted(((op, tuple(sorted(r))) for op, r in by_op.items()), key=_most_first)
    return Desync(group=group, seq=seq, variants=tuple(variants))


def _most_first(variant: tuple[str, tuple[int, ...]]) -> tuple[int, str]:
    return -len(variant[1]), variant[0]


def desync_culprits(d: Desync) -> Culprits:
    """A hang's culprits when its ranks desynced: those that entered another collective than
    most members (who wait for them in it)."""
    op, waiting = d.variants[0]
    return Culprits(
        ranks=d.culprits, group=d.group, seq=d.seq, op=op, num_waiting=len(waiting),
        resolved=d.resolved, desync=d.variants,
    )  # fmt: skip


def find_culprits(
    waits: Sequence[Wait], seqs: dict[str, dict[int, int]], alive: Iterable[int]
) -> Culprits | None:
    """Follow the wait-for graph from every waiting rank to ranks that are not waiting.

    `seqs[group][rank]` is the last sequence number `rank` entered in `group`; membership of a
    group is the ranks ever seen in it. `alive` are all ranks known to the job.
    """
    if not waits:
        return behind_everywhere(seqs)
    waiting = {w.rank: w for w in waits}
    culprits: set[int] = set()
    frontier = list(waiting.values())
    visited: set[int] = set(waiting)
    while frontier:
        wait = frontier.pop()
        for member, seq in seqs.get(wait.group, {}).items():
            if seq >= wait.seq or member in visited:
                continue
            visited.add(member)
            if member in waiting:
                frontier.append(waiting[member])
            else:
                culprits.add(member)
    blocked = {c for c in culprits if _ahead_of_idle(c, seqs, set(waiting))}
    if blocked:
        # A "culprit" that entered a collective some other non-waiting rank has not is itself
        # blocked there, in a wait the SDK cannot see (FSDP2 and DTensor collectives are
        # asynchronous): it is a victim. Without other candidates, positions name the rank
        # behind everywhere.
        if blocked == culprits:
            behind = behind_everywhere(seqs)
            if behind is not None:
                return dataclasses.replace(behind, num_waiting=len(waiting))
        else:
            culprits -= blocked
    target = _deepest_wait(waits, culprits, seqs)
    if culprits:
        return Culprits(
            ranks=tuple(sorted(culprits)),
            group=target.group,
            seq=target.seq,
            op=target.op,
            num_waiting=len(waiting),
            resolved=True,
        )
    idle = sorted(set(alive) - set(waiting))
    if not idle or len(idle) * 2 > len(waiting) + len(idle):
        return behind_everywhere(seqs)
    return Culprits(
        ranks=tuple(idle),
        group=target.group,
        seq=target.seq,
        op=target.op,
        num_waiting=len(waiting),
        resolved=False,
    )


def _ahead_of_idle(rank: int, seqs: dict[str, dict[int, int]], waiting: set[int]) -> bool:
    """Has `rank` entered, in some group, a collective that a non-waiting peer has not?"""
    for members in seqs.values():
        mine = members.get(rank)
        if mine is None:
            continue
        for peer, seq in members.items():
            if peer != rank and peer not in waiting and seq < mine:
                return True
    return False


def behind_everywhere(seqs: dict[str, dict[int, int]]) -> Culprits | None:
    """Culprits when no rank says it is waiting (asynchronous collectives, e.g. FSDP2 and
    DTensor, block in a wait the SDK cannot see): once progress has stopped, positions are
    frozen, and the ranks that are behind a peer in some group and ahead of none in any group
    never entered what their peers did."""
    ahead: set[int] = set()
    behind: dict[int, tuple[str, int]] = {}
    for group, members in sorted(seqs.items()):
        if len(members) < 2:
            continue
        top = max(members.values())
        if min(members.values()) == top:
            continue
        for rank, seq in members.items():
            if seq < top:
                gap = behind.get(rank)
                if gap is None or top - seq > gap[1] - members[rank]:
                    behind[rank] = (group, top)
            else:
                ahead.add(rank)
    culprits = sorted(set(behind) - ahead)
    if not culprits:
        return None
    group, seq = behind[culprits[0]]
    peers = {r for r, q in seqs[group].items() if q >= seq}
    return Culprits(
        ranks=tuple(culprits), group=group, seq=seq, op="", num_waiting=len(peers), resolved=True
    )


def _deepest_wait(
    waits: Sequence[Wait], culprits: set[int], seqs: dict[str, dict[int, int]]
) -> Wait:
    """The collective the culprits should have entered: the wait they block most directly.

    Among the collectives ranks wait in, pick one a culprit has not entered with the fewest
    members missing (a hang in a node's tensor-parallel group also stalls the data-parallel
    all-reduce; the tensor-parallel collective is the one to name).
    """
    # In (group, seq) order: ties go the same way whichever rank's heartbeat arrived first.
    candidates = [w for _, w in sorted({(w.group, w.seq): w for w in waits}.items())]
    best, best_missing = candidates[0], None
    for wait in candidates:
        members = seqs.get(wait.group, {})
        missing = [m for m, seq in members.items() if seq < wait.seq]
        if not culprits.intersection(missing):
            continue
        if best_missing is None or len(missing) < best_missing:
            best, best_missing = wait, len(missing)
    return best
