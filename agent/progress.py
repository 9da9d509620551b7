"""The per-rank progress page: a small mmap'd file in /dev/shm the node agent can read while the
training process is wedged. Pages live in per-run folders (`rundir.py` names and removes them).

Layout (little-endian, fixed offsets; `PAGE_VERSION` changes with it):

| offset | block   | written by | holds |
|--------|---------|------------|-------|
| 0      | meta    | SDK, once  | magic, version, capacity, pid, rank, world, job, node, pid ns |
| 256    | live    | SDK        | state, last step, last (group, seq, op), timestamps, ring head |
| 384    | step    | SDK        | last step's time, MFU, comm wait, collective time, tokens, loss |
| 512    | health  | SDK        | errors, dropped/queued records, ship errors, quarantined batches |
| 576    | control | agent/SDK  | a control request (seq, kind) from the agent and the SDK's ack |
| 640    | later   | SDK thread | newest op published after launch: ring head, last op, times |
| 1024   | ring    | SDK        | the last `capacity` collective events, 128-byte slots |

Every block written while others may read is guarded by a seqlock (odd while writing); readers
retry a bounded number of times. Ops that run behind compute (DDP's gradient buckets) are put on
the page after their launch by the SDK's background thread (`publish_events`), not in the
training thread's backward: their slots and the "later" block are that thread's alone, and a
reader takes the position (ring head, last op, progress time) of whichever block saw the newer
op. This module owns the layout and nothing else: no torch, no threads, no network.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

from vigil import schema

MAGIC = b"VGLPAGE1"
PAGE_VERSION = 1
PAGE_SUFFIX = ".page"

# The PID namespace (`readlink /proc/self/ns/pid`) sits in what was padding: older pages read "".
_META = struct.Struct("<8sIIIIIII4x128s64s24s")
# state, checkpoints, last step, progress mono/wall, step start mono, last seq, last group, last
# op, ring head. The checkpoint count (checkpoint spans finished) sits in what was padding:
# older pages read 0.
_LIVE = struct.Struct("<BxxxIqdddQ32s24sQ")
_STEP = struct.Struct("<qdddddqd")
_HEALTH = struct.Struct("<QQQQQ")
_CONTROL = struct.Struct("<Q16s")
_ACK = struct.Struct("<Q")
_SLOT = struct.Struct("<QqQddd32s24s16s")
_SEQ = struct.Struct("<Q")
_F64 = struct.Struct("<d")
# ring head, last seq, last group, last op, progress mono/wall (`publish_events`)
_LATER = struct.Struct("<QQ32s24sdd")

_OFF_META = 0
_OFF_LIVE = 256
_OFF_STEP = 384
_OFF_HEALTH = 512
_OFF_CONTROL = 576
_OFF_ACK = 608
_OFF_LATER = 640
_OFF_RING = 1024
SLOT_SIZE = 128
# A reader retries a block that is being written; in the writer's own process it must also let
# the writer run (the GIL), hence the short sleeps. 1 s without a stable read means a wedged writer
# died mid-write (the block stays odd forever).
_READ_DEADLINE_S = 1.0

STATE_CODES: dict[schema.RankState, int] = {s: i for i, s in enumerate(schema.RankState)}
CODE_STATES: dict[int, schema.RankState] = {i: s for s, i in STATE_CODES.items()}
# Enum members hash through a Python-level __hash__; the hot paths look members up by identity.
_CODES_BY_ID: dict[int, int] = {id(s): i for s, i in STATE_CODES.items()}
_IN_COLLECTIVE = STATE_CODES[schema.RankState.IN_COLLECTIVE]
_COMPUTE = STATE_CODES[schema.RankState.COMPUTE]


def _state_code(state: schema.RankState) -> int:
    code = _CODES_BY_ID.get(id(state))
    return STATE_CODES[state] if code is None else code


assert _OFF_LIVE + 8 + _LIVE.size <= _OFF_STEP
assert _OFF_STEP + 8 + _STEP.size <= _OFF_HEALTH
assert _OFF_HEALTH + 8 + _HEALTH.size <= _OFF_CONTROL
assert _OFF_CONTROL + _CONTROL.size <= _OFF_ACK
assert _OFF_ACK + _ACK.size <= _OFF_LATER and _OFF_LATER + 8 + _LATER.size <= _OFF_RING
assert 8 + _SLOT.size <= SLOT_SIZE


def page_path(progress_dir: Path, job: str, rank: int, run_id: str | None = None) -> Path:
    """Rank `rank`'s page of run `run_id` of `job` (`<root>/<job>/<run>/`, see `rundir.py`);
    without a run id, the newest run's page of that rank that exists (FileNotFoundError if none)."""
    name = f"rank-{rank:05d}{PAGE_SUFFIX}"
    if run_id is not None:
        return Path(progress_dir) / job / run_id / name
    found = sorted(Path(progress_dir).glob(f"{glob_escape(job)}/*/{name}"), key=_mtime)
    if not found:
        raise FileNotFoundError(f"no page of rank {rank} of job {job!r} under {progress_dir}")
    return found[-1]


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


@functools.lru_cache(maxsize=4096)  # group/op/dtype names repeat: encode each once
def _enc(text: str, size: int) -> bytes:
    return text.encode("utf-8")[:size]


def encode_group(name: str) -> bytes:
    """A process group's name as the page stores it (callers on hot paths encode once)."""
    return _enc(name, 32)


def encode_op(op: str) -> bytes:
    return _enc(op, 24)


def encode_dtype(dtype: str) -> bytes:
    return _enc(dtype, 16)


class LaterEvent(NamedTuple):
    """An op put on the page after its launch (`PageWriter.publish_events`): `wall`/`mono`
    its launch, `end_wall` its end (0: not yet)."""

    ring_index: int
    seq: int
    step: int
    nbytes: int
    wall: float
    mono: float
    end_wall: float
    group_b: bytes
    op_b: bytes
    dtype_b: bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSummary:
    step: int = -1
    step_time_s: float = 0.0
    mfu: float = 0.0
    comm_wait_s: float = 0.0
    collective_s: float = 0.0
    end_wall_s: float = 0.0
    tokens: int = 0
    loss: float = float("nan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Health:
    internal_errors: int = 0
    dropped_records: int = 0
    ship_errors: int = 0
    queued_records: int = 0
    quarantined_batches: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageSnapshot:
    """One consistent reading of a rank's page."""

    path: Path
    job: str
    node: str
    rank: int
    world_size: int
    local_rank: int
    pid: int
    # The writer's PID namespace ("" when unknown): `pid` means nothing in another one.
    pid_ns: str = ""
    capacity: int
    state: schema.RankState
    last_step: int
    progress_mono_s: float
    progress_wall_s: float
    step_start_mono_s: float
    last_group: str
    last_seq: int
    last_op: str
    ring_head: int
    last: StepSummary
    # Checkpoint spans this rank has finished: a rank still in a save its peers finished is
    # behind them (the analyzer's hang tracker), not in a long save every rank makes.
    checkpoints: int = 0
    health: Health


class PageWriter:
    """The SDK side: creates the page and updates it in place (a few microseconds per update)."""

    def __init__(
        self,
        path: Path,
        *,
        job: str,
        node: str,
        rank: int,
        world_size: int,
        local_rank: int,
        capacity: int,
        pid_ns: str = "",
    ) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = _OFF_RING + capacity * SLOT_SIZE
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _META.pack_into(
            self._map,
            _OFF_META,
            MAGIC,
            PAGE_VERSION,
            capacity,
            SLOT_SIZE,
            os.getpid(),
            rank,
            world_size,
            local_rank,
            _enc(job, 128),
            _enc(node, 64),
            _enc(pid_ns, 24),
        )
        self._seq = {_OFF_STEP: 0, _OFF_HEALTH: 0, _OFF_LATER: 0}
        self._later_head = 0  # the ring head as of the newest op `publish_events` wrote
        self._live_seq = 0
        starting = STATE_CODES[schema.RankState.STARTING]
        self._live: list[object] = [starting, 0, -1, 0.0, 0.0, 0.0, 0, b"", b"", 0]
        self._write_live()
        os.replace(tmp, self.path)  # readers never see a half-initialised page

    def _guarded(self, offset: int, packer: struct.Struct, *values: object) -> None:
        seq = self._seq[offset] + 1
        _SEQ.pack_into(self._map, offset, seq)
        packer.pack_into(self._map, offset + 8, *values)
        self._seq[offset] = seq + 1
        _SEQ.pack_into(self._map, offset, seq + 1)

    def _write_live(self) -> None:
        seq = self._live_seq + 1
        buf = self._map
        _SEQ.pack_into(buf, _OFF_LIVE, seq)
        _LIVE.pack_into(buf, _OFF_LIVE + 8, *self._live)
        self._live_seq = seq + 1
        _SEQ.pack_into(buf, _OFF_LIVE, seq + 1)

    @property
    def checkpoints(self) -> int:
        """Checkpoint spans finished so far (see `progress(checkpoint_done=...)`)."""
        return cast(int, self._live[1])

    def progress(
        self,
        state: schema.RankState,
        *,
        now_mono: float,
        now_wall: float,
        step: int | None = None,
        checkpoint_done: bool = False,
    ) -> None:
        """Mark progress: a new state (and step) at this instant; `checkpoint_done`: a
        checkpoint span just ended (counted in the page's `checkpoints`)."""
        live = self._live
        live[0] = _state_code(state)
        if checkpoint_done:
            live[1] = cast(int, live[1]) + 1
        if step is not None:
            live[2] = step
            live[5] = now_mono
        live[3], live[4] = now_mono, now_wall
        self._write_live()

    def step_begun(self, step: int, now_mono: float, now_wall: float) -> None:
        """`progress(COMPUTE, now_mono=..., now_wall=..., step=step)`, positional (the step
        boundary's hot path)."""
        live = self._live
        live[0] = _COMPUTE
        live[2] = step
        live[3], live[4], live[5] = now_mono, now_wall, now_mono
        self._write_live()

    def step_ended(
        self,
        step: int,
        step_time_s: float,
        mfu: float,
        comm_wait_s: float,
        collective_s: float,
        now_mono: float,
        now_wall: float,
        tokens: int,
        loss: float,
    ) -> None:
        """`step_done(...)` (its end at `now_wall`) then `progress(COMPUTE, now_mono=...,
        now_wall=...)`, in one call (the step boundary's hot path)."""
        self._guarded(
            _OFF_STEP, _STEP, step, step_time_s, mfu, comm_wait_s, collective_s, now_wall, tokens,
            loss,
        )  # fmt: skip
        live = self._live
        live[0] = _COMPUTE
        live[3], live[4] = now_mono, now_wall
        self._write_live()

    def collective(
        self, group: str, seq: int, op: str, *, entering: bool, now_mono: float, now_wall: float
    ) -> None:
        """Mark entering (or leaving) collective `seq` of `group`."""
        self.mark_collective(encode_group(group), seq, encode_op(op), entering, now_mono, now_wall)

    def mark_collective(
        self,
        group_b: bytes,
        seq: int,
        op_b: bytes,
        entering: bool,
        now_mono: float,
        now_wall: float,
    ) -> None:
        """`collective()` with encoded names and positional arguments (the recorder's hot path)."""
        live = self._live
        live[0] = _IN_COLLECTIVE if entering else _COMPUTE
        live[3], live[4] = now_mono, now_wall
        live[6], live[7], live[8] = seq, group_b, op_b
        self._write_live()

    def begin_event(
        self,
        index: int,
        seq: int,
        step: int,
        nbytes: int,
        wall: float,
        group_b: bytes,
        op_b: bytes,
        dtype_b: bytes,
        entering: bool,
        now_mono: float,
    ) -> None:
        """`write_event(index, ..., enqueue_s=start_s=wall, end_s=0)` then `collective(group, seq,
        op, entering=entering, now_mono=now_mono, now_wall=wall)`, in one call (the hot path).
        Names come encoded once by the caller (`encode_group`, `encode_op`, `encode_dtype`)."""
        buf = self._map
        capacity = self.capacity
        offset = _OFF_RING + (index % capacity) * SLOT_SIZE
        version = (index // capacity) * 2 + 1
        _SEQ.pack_into(buf, offset, version)
        _SLOT.pack_into(buf, offset + 8, seq, step, nbytes, wall, wall, 0.0, group_b, op_b, dtype_b)
        _SEQ.pack_into(buf, offset, version + 1)
        live = self._live
        live[9] = index + 1
        live[0] = _IN_COLLECTIVE if entering else _COMPUTE
        live[3], live[4] = now_mono, wall
        live[6], live[7], live[8] = seq, group_b, op_b
        self._write_live()

    def publish_events(self, events: Sequence[LaterEvent]) -> None:
        """Put ops launched earlier on the page from a thread other than the training thread:
        their ring slots (with their end where known) and, where the newest of them is newer
        than every op on the page, the "later" block's position. One publishing thread at a
        time; the training thread's own writes never touch these slots (each index is written
        once) nor that block. A slot the ring has lapped since its op's launch is skipped."""
        capacity = self.capacity
        newest: LaterEvent | None = None
        for event in events:
            index = event.ring_index
            if index < max(cast(int, self._live[9]), self._later_head) - capacity:
                continue  # newer ops already own its slot
            self._slot(
                index, event.seq, event.step, event.nbytes, event.wall, event.wall,
                event.end_wall, event.group_b, event.op_b, event.dtype_b,
            )  # fmt: skip
            if newest is None or index > newest.ring_index:
                newest = event
        if newest is not None and newest.ring_index + 1 > self._later_head:
            self._later_head = newest.ring_index + 1
            self._guarded(
                _OFF_LATER, _LATER, self._later_head, newest.seq, newest.group_b, newest.op_b,
                newest.mono, newest.wall,
            )  # fmt: skip

    def _slot(
        self,
        index: int,
        seq: int,
        step: int,
        nbytes: int,
        enqueue_s: float,
        start_s: float,
        end_s: float,
        group_b: bytes,
        op_b: bytes,
        dtype_b: bytes,
    ) -> None:
        """Ring slot `index % capacity`, seqlocked by its lap (`begin_event` inlines this)."""
        offset = _OFF_RING + (index % self.capacity) * SLOT_SIZE
        version = (index // self.capacity) * 2 + 1
        _SEQ.pack_into(self._map, offset, version)
        _SLOT.pack_into(
            self._map, offset + 8, seq, step, nbytes, enqueue_s, start_s, end_s, group_b, op_b,
            dtype_b,
        )  # fmt: skip
        _SEQ.pack_into(self._map, offset, version + 1)

    def write_event(
        self,
        index: int,
        *,
        seq: int,
        step: int,
        nbytes: int,
        enqueue_s: float,
        start_s: float,
        end_s: float,
        group: str,
        op: str,
        dtype: str,
    ) -> None:
        """Write ring slot `index % capacity` (index counts every event ever written)."""
        self._slot(
            index, seq, step, nbytes, enqueue_s, start_s, end_s, _enc(group, 32), _enc(op, 24),
            _enc(dtype, 16),
        )  # fmt: skip
        # The ring head reaches readers with the next live-block write (the collective() call
        # that follows every write_event), saving one seqlocked write per collective.
        self._live[9] = index + 1

    def finish_event(self, index: int, end_s: float) -> None:
        """Fill in the completion time of an event written earlier (if its slot still holds it)."""
        offset = _OFF_RING + (index % self.capacity) * SLOT_SIZE
        version = (index // self.capacity) * 2 + 2
        if _SEQ.unpack_from(self._map, offset)[0] == version:
            _F64.pack_into(self._map, offset + 8 + 40, end_s)

    def step_done(
        self,
        step: int,
        step_time_s: float,
        mfu: float = 0.0,
        comm_wait_s: float = 0.0,
        collective_s: float = 0.0,
        end_wall_s: float = 0.0,
        tokens: int = 0,
        loss: float = math.nan,
    ) -> None:
        """The last finished step (`StepSummary`'s fields; positional on the step-end path)."""
        self._guarded(
            _OFF_STEP,
            _STEP,
            step,
            step_time_s,
            mfu,
            comm_wait_s,
            collective_s,
            end_wall_s,
            tokens,
            loss,
        )

    def health(self, health: Health) -> None:
        self._guarded(
            _OFF_HEALTH,
            _HEALTH,
            health.internal_errors,
            health.dropped_records,
            health.ship_errors,
            health.queued_records,
            health.quarantined_batches,
        )

    def control(self) -> tuple[int, str]:
        """The latest control request (seq, kind) the agent wrote; seq 0 means none."""
        seq, kind = _CONTROL.unpack_from(self._map, _OFF_CONTROL)
        return int(seq), _text(kind)

    def control_seq(self) -> int:
        """The latest control request's seq alone (cheaper than `control()`)."""
        return int(_ACK.unpack_from(self._map, _OFF_CONTROL)[0])

    def ack(self, seq: int) -> None:
        _ACK.pack_into(self._map, _OFF_ACK, seq)

    def close(self, *, unlink: bool = False) -> None:
        try:
            self._map.close()
        finally:
            if unlink:
                self.path.unlink(missing_ok=True)


class PageReader:
    """The agent side: maps a page read-write (for control requests) and reads snapshots."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        if len(self._map) < _OFF_RING or self._map[:8] != MAGIC:
            self._map.close()
            raise ValueError(f"{self.path} is not a vigil progress page (bad magic)")
        meta = _META.unpack_from(self._map, _OFF_META)
        if meta[1] != PAGE_VERSION:
            self._map.close()
            raise ValueError(f"{self.path}: page version {meta[1]}, expected {PAGE_VERSION}")
        (_, _, self.capacity, _, self.pid, self.rank, self.world_size, self.local_rank) = meta[:8]
        self.job, self.node, self.pid_ns = _text(meta[8]), _text(meta[9]), _text(meta[10])

    def _read(self, offset: int, packer: struct.Struct) -> tuple[Any, ...]:
        deadline = 0.0
        while True:
            before = _SEQ.unpack_from(self._map, offset)[0]
            if not before % 2:
                values = packer.unpack_from(self._map, offset + 8)
                if _SEQ.unpack_from(self._map, offset)[0] == before:
                    return tuple(values)
            now = time.monotonic()
            deadline = deadline or now + _READ_DEADLINE_S
            if now > deadline:
                raise TimeoutError(f"{self.path}: page block at {offset} kept changing while read")
            time.sleep(0.0005)

    def snapshot(self) -> PageSnapshot:
        live = list(self._read(_OFF_LIVE, _LIVE))
        head, seq, group, op, mono, wall = self._read(_OFF_LATER, _LATER)
        if head > live[9]:  # an op published after its launch is the newest on the page ...
            live[9] = head
            if live[0] != _IN_COLLECTIVE:  # ... and the rank's position, unless it is inside one
                live[6:9] = seq, group, op
                live[3], live[4] = max(live[3], mono), max(live[4], wall)
        step = self._read(_OFF_STEP, _STEP)
        health = self._read(_OFF_HEALTH, _HEALTH)
        last = StepSummary()
        if step[0] >= 0 and step[1] > 0:
            last = StepSummary(
                step=step[0],
                step_time_s=step[1],
                mfu=step[2],
                comm_wait_s=step[3],
                collective_s=step[4],
                end_wall_s=step[5],
                tokens=step[6],
                loss=step[7],
            )
        return PageSnapshot(
            path=self.path,
            job=self.job,
            node=self.node,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            pid=self.pid,
            pid_ns=self.pid_ns,
            capacity=self.capacity,
            state=CODE_STATES.get(live[0], schema.RankState.COMPUTE),
            last_step=live[2],
            progress_mono_s=live[3],
            progress_wall_s=live[4],
            step_start_mono_s=live[5],
            last_seq=live[6],
            last_group=_text(live[7]),
            last_op=_text(live[8]),
            ring_head=live[9],
            checkpoints=live[1],
            last=last,
            health=Health(
                internal_errors=health[0],
                dropped_records=health[1],
                ship_errors=health[2],
                queued_records=health[3],
                quarantined_batches=health[4],
            ),
        )

    def events(self, *, job: str | None = None) -> list[schema.CollectiveEvent]:
        """The ring's events, oldest first (slots being written right now are skipped)."""
        head = self.snapshot().ring_head
        first = max(0, head - self.capacity)
        return [e for e in self._iter_events(first, head, job or self.job) if e is not None]

    def _iter_events(
        self, first: int, head: int, job: str
    ) -> Iterator[schema.CollectiveEvent | None]:
        for index in range(first, head):
            offset = _OFF_RING + (index % self.capacity) * SLOT_SIZE
            version = _SEQ.unpack_from(self._map, offset)[0]
            if version != (index // self.capacity) * 2 + 2:
                yield None
                continue
            seq, step, nbytes, enq, start, end, group, op, dtype = _SLOT.unpack_from(
                self._map, offset + 8
            )
            yield schema.CollectiveEvent(
                job_id=job,
                rank=self.rank,
                group=_text(group) or "?",
                seq=seq,
                op=_text(op) or "?",
                bytes=nbytes,
                dtype=_text(dtype),
                step=max(0, step),
                enqueue_s=enq,
                start_s=start,
                end_s=end,
            )

    def request_control(self, kind: str) -> int:
        """Ask the rank to run its `kind` callback at its next step boundary; returns the seq."""
        if not kind or len(kind.encode()) > 16:
            raise ValueError(f"control kind {kind!r} must be 1..16 bytes")
        seq = int(_CONTROL.unpack_from(self._map, _OFF_CONTROL)[0]) + 1
        _CONTROL.pack_into(self._map, _OFF_CONTROL, seq, kind.encode())
        return seq

    def acked(self) -> int:
        return int(_ACK.unpack_from(self._map, _OFF_ACK)[0])

    def close(self) -> None:
        self._map.close()


def discover(progress_dir: Path, job: str | None = None) -> list[Path]:
    """Every rank page under `progress_dir` (`<job>/<run>/rank-NNNNN.page`), or `job`'s alone."""
    root = Path(progress_dir)
    if not root.is_dir():
        return []
    return sorted(root.glob(f"{'*' if job is None else glob_escape(job)}/*/*{PAGE_SUFFIX}"))
