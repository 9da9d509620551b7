"""Flight Recorder import and hang analysis: torch's per-rank collective ring-buffer dumps.

Reads both dump encodings torch writes (`_dump_fr_trace`: pickle; `_dump_fr_trace_json`: JSON)
from NCCL and gloo process groups. The two backends differ: NCCL entries carry states
(scheduled/started/completed) and timings and `pg_config` lists each group's ranks; gloo entries
stay "scheduled" with no timings and `pg_config` holds one empty entry, so group membership is
inferred from which dumps mention the group, and `pg_status` gives the last enqueued sequence
numbers. The rank is the trailing number of the file name (torch names dumps `<prefix><rank>`).

Pickles are loaded with an unpickler that refuses every class (dumps hold only builtins), so a
hostile file cannot run code. Analysis: per process group the last sequence number each rank
enqueued and completed; ranks waiting in a collective point at the members that never entered
it (`hangs.find_culprits`); ops that differ at one sequence number are a desync. Stacks recorded
with the entries are grouped by identity. Pure apart from reading the given files.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vigil import schema
from vigil.analyzer import findings, hangs, waitgraph
from vigil.analyzer import stacks as stacks_mod

_TRAILING_NUMBER = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")
MAX_DUMP_BYTES = 512 * 1024 * 1024  # a 20,000-entry buffer with stacks is ~100 MB


class DumpError(ValueError):
    """A dump could not be read; names the file and why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: dumps hold only builtins")


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One collective (or p2p op) in a rank's ring buffer."""

    group: str
    group_desc: str
    pg_id: int
    seq: int
    p2p_seq: int
    is_p2p: bool
    op: str
    state: str
    sizes: str
    started_ns: int | None
    completed_ns: int | None
    duration_ms: float | None
    frames: tuple[str, ...] = ()


@dataclass(kw_only=True)
class Dump:
    """One rank's Flight Recorder dump."""

    path: str
    rank: int
    version: str
    backend: str  # "nccl", "gloo" or "" when no entry says
    members: dict[str, list[int]]  # group name -> ranks, from pg_config (empty for gloo)
    status: dict[str, dict[str, int]]  # group name -> last_enqueued/started/completed
    entries: list[Entry] = field(default_factory=list)


def looks_like_dump(head: bytes) -> bool:
    """Whether the first bytes of a file look like a Flight Recorder dump."""
    return head.startswith(b"\x80") or (b'"pg_config"' in head or b'"entries"' in head)


def load(path: str | Path, *, rank: int | None = None) -> Dump:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_DUMP_BYTES:
            raise DumpError(str(p), f"larger than {MAX_DUMP_BYTES} bytes")
        raw = p.read_bytes()
    except OSError as exc:
        raise DumpError(str(p), f"cannot read ({exc})") from exc
    return parse(raw, path=str(p), rank=rank)


def parse(raw: bytes, *, path: str = "<bytes>", rank: int | None = None) -> Dump:
    try:
        is_pickle = raw.startswith(b"\x80")
        doc = _BuiltinsOnly(io.BytesIO(raw)).load() if is_pickle else json.loads(raw)
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
    ) as exc:
        raise DumpError(path, f"corrupt or truncated dump ({type(exc).__name__}: {exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", []), list):
        raise DumpError(path, "not a Flight Recorder dump (no entries list)")
    if rank is None:
        match = _TRAILING_NUMBER.search(Path(path).name)
        if match is None:
            raise DumpError(
                path, "cannot tell the rank: name dumps <prefix><rank>, e.g. nccl_trace_rank_3"
            )
        rank = int(match.group(1))
    try:
        return _dump(doc, path, rank)
    except (KeyError, TypeError, ValueError) as exc:
        raise DumpError(path, f"unexpected dump layout ({type(exc).__name__}: {exc})") from exc


def _dump(doc: dict[str, Any], path: str, rank: int) -> Dump:
    entries = [_entry(e) for e in doc.get("entries", [])]
    names = {e.pg_id: e.group for e in entries}
    status: dict[str, dict[str, int]] = {}
    for pg_id, values in (doc.get("pg_status") or {}).items():
        group = names.get(int(pg_id), str(pg_id))
        status[group] = {k: int(v) for k, v in values.items()}
    members: dict[str, list[int]] = {}
    for key, cfg in (doc.get("pg_config") or {}).items():
        ranks = _ranks(cfg.get("ranks", "[]"))
        if key and ranks:  # gloo writes one entry with an empty name and no ranks
            members[str(cfg.get("name") or key)] = ranks
    ops = {e.op.split(":", 1)[0] for e in entries if ":" in e.op}
    backend = "nccl" if "nccl" in ops else "gloo" if "gloo" in ops else ""
    return Dump(
        path=path,
        rank=rank,
        version=str(doc.get("version", "")),
        backend=backend,
        members=members,
        status=status,
        entries=entries,
    )


def _ranks(value: Any) -> list[int]:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return [int(r) for r in value]


def _entry(e: Mapping[str, Any]) -> Entry:
    pg = e.get("process_group") or ("", "")
    frames = tuple(
        f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})"
        for f in e.get("frames") or ()
    )
    return Entry(
        group=str(pg[0]),
        group_desc=str(pg[1]) if len(pg) > 1 else "",
        pg_id=int(e.get("pg_id", -1)),
        seq=int(e.get("collective_seq_id", 0)),
        p2p_seq=int(e.get("p2p_seq_id", 0)),
        is_p2p=bool(e.get("is_p2p", False)),
        op=str(e.get("profiling_name", "")),
        state=str(e.get("state", "")),
        sizes=str(e.get("input_sizes", "")),
        started_ns=_ns(e.get("time_discovered_started_ns")),
        completed_ns=_ns(e.get("time_discovered_completed_ns")),
        duration_ms=float(e["duration_ms"]) if e.get("duration_ms") is not None else None,
        frames=frames,
    )


def _ns(value: Any) -> int | None:
    return int(value) if value else None  # gloo writes None (pickle) or 0 (JSON)


@dataclass(frozen=True, kw_only=True)
class GroupState:
    """Where each member of one process group got to."""

    group: str
    enqueued: dict[int, int]
    ops: dict[int, dict[int, str]]  # seq -> rank -> op


def group_states(dumps: Sequence[Dump]) -> list[GroupState]:
    enq: dict[str, dict[int, int]] = defaultdict(dict)
    ops: dict[str, dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    for d in dumps:  # pg_status's completion counters are not used (see `analyze`)
        for e in d.entries:
            if e.is_p2p:
                continue
            enq[e.group][d.rank] = max(enq[e.group].get(d.rank, 0), e.seq)
            ops[e.group][e.seq][d.rank] = f"{e.op} {e.sizes}"
        for group, st in d.status.items():
            enq[group][d.rank] = max(
                enq[group].get(d.rank, 0), st.get("last_enqueued_collective", 0)
            )
        for group, ranks in d.members.items():
            for r in ranks:
                enq[group].setdefault(r, 0)  # a member that never dumped or never entered
    return [GroupState(group=g, enqueued=dict(enq[g]), ops=dict(ops[g])) for g in sorted(enq)]


def group_stacks(stacks: Mapping[int, Sequence[str]]) -> list[tuple[list[int], tuple[str, ...]]]:
    """Ranks grouped by identical stack, largest group first (see `stacks.group`)."""
    return stacks_mod.group(stacks)


def analyze(dumps: Sequence[Dump], *, job_id: str, now_s: float = 0.0) -> list[schema.Finding]:
    """Hang and desync findings from one job's dumps (one per rank).

    A rank is where its last collective entry says. It waits there when some member of that
    group has not enqueued that sequence number yet, or (NCCL, which records states) when the
    entry has not completed. gloo's completion counters are not trusted: they can advance
    for collectives a peer never entered.
    """
    states = group_states(dumps)
    enqueued = {st.group: dict(st.enqueued) for st in states}
    waits = []
    for d in dumps:
        last = next((e for e in reversed(d.entries) if not e.is_p2p), None)
        if last is None:
            continue
        members = enqueued.get(last.group, {})
        behind = any(seq < last.seq for seq in members.values())
        unfinished = d.backend == "nccl" and last.state != "completed"
        if behind or unfinished:
            waits.append(hangs.Wait(rank=d.rank, group=last.group, seq=last.seq, op=last.op))
    out = _desyncs(states, job_id, now_s)
    culprits = hangs.find_culprits(waits, enqueued, {d.rank for d in dumps})
    if culprits is not None:
        out.append(_hang(culprits, dumps, job_id, now_s))
    elif waits:
        out.append(_stuck_inside(waits, job_id, now_s))
    return out


def _hang(c: hangs.Culprits, dumps: Sequence[Dump], job_id: str, now_s: float) -> schema.Finding:
    stacks = {d.rank: d.entries[-1].frames for d in dumps if d.entries and d.entries[-1].frames}
    grouped = group_stacks(stacks)
    ev = [
        findings.evidence("waited_seq", c.seq, note=f"group {c.group!r}, op {c.op}"),
        findings.evidence("ranks_waiting", c.num_waiting),
    ]
    for ranks, stack in grouped[:4]:
        ev.append(
            findings.evidence(
                "stack_group_ranks", len(ranks), note=f"ranks {ranks}: {' <- '.join(stack[:3])}"
            )
        )
    return findings.make_finding(
        kind=schema.FindingKind.HANG,
        job_id=job_id,
        subjects=schema.Subjects(ranks=list(c.ranks)),
        summary=(
            f"Flight Recorder: rank(s) {list(c.ranks)} never entered {c.op or 'collective'} "
            f"#{c.seq} of group {c.group!r} that {c.num_waiting} rank(s) wait in; "
            f"{len(grouped)} distinct stack(s)"
        ),
        step_start=-1,
        step_end=-1,
        evidence=ev,
        confidence=0.9 if c.resolved else 0.55,
        detected_s=now_s,
    )


def _stuck_inside(waits: Sequence[hangs.Wait], job_id: str, now_s: float) -> schema.Finding:
    w = waits[0]
    ranks = sorted({x.rank for x in waits})
    return findings.make_finding(
        kind=schema.FindingKind.HANG,
        job_id=job_id,
        subjects=schema.Subjects(ranks=ranks),
        summary=(
            f"Flight Recorder: every member entered {w.op or 'collective'} #{w.seq} of group "
            f"{w.group!r} but it never completed: suspect the network or a device, not a rank"
        ),
        evidence=[findings.evidence("waited_seq", w.seq, note=f"group {w.group!r}")],
        confidence=0.6,
        detected_s=now_s,
    )


def _desyncs(states: Sequence[GroupState], job_id: str, now_s: float) -> list[schema.Finding]:
    out = []
    for st in states:
        for seq, by_rank in sorted(st.ops.items()):
            d = waitgraph.desync(st.group, seq, by_rank)
            if d is None:
                continue
            out.append(
                findings.make_finding(
                    kind=schema.FindingKind.HANG,
                    job_id=job_id,
                    subjects=schema.Subjects(ranks=list(d.culprits)),
                    summary=f"collective desync in group {st.group!r} at #{seq}: "
                    + "; ".join(f"{op} on ranks {list(r)}" for op, r in d.variants),
                    evidence=[findings.evidence("desync_seq", seq, note=f"group {st.group!r}")],
                    confidence=0.85,
                    detected_s=now_s,
                )
            )
            break  # the first desync in a group explains the rest
    return out
