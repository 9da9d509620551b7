"""The per-rank progress page: a small mmap'd file in /dev/shm the node agent can read while the
training process is wedged. `PageWriter` is the SDK's side (it creates the page and updates it in
place), `PageReader` the agent's (consistent snapshots, the ring of collectives, control
requests). Where each block sits and how it is packed is `pagelayout.py`'s; its names a caller
needs are re-exported here. No torch, no threads, no network.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from vigil import schema
from vigil.agent.pagelayout import (
    ACK,
    BETWEEN_STEPS,
    CODE_STATES,
    COMPILING,
    COMPUTE,
    CONTROL,
    F64,
    HEALTH,
    IN_COLLECTIVE,
    LATER,
    LIVE,
    MAGIC,
    META,
    OFF_ACK,
    OFF_CONTROL,
    OFF_HEALTH,
    OFF_LATER,
    OFF_LIVE,
    OFF_META,
    OFF_RING,
    OFF_STEP,
    PAGE_SUFFIX,
    PAGE_VERSION,
    SEQ,
    SLOT,
    SLOT_SIZE,
    STATE_CODES,
    STEP,
    Health,
    LaterEvent,
    PageSnapshot,
    StepSummary,
    decode_name,
    discover,
    encode_dtype,
    encode_group,
    encode_name,
    encode_op,
    page_path,
    state_code,
)

__all__ = [
    "PAGE_SUFFIX", "Health", "LaterEvent", "PageReader", "PageSnapshot", "PageWriter",
    "StepSummary", "discover", "encode_dtype", "encode_group", "encode_op", "page_path",
]  # fmt: skip

# A reader retries a block that is being written; in the writer's own process it must also let
# the writer run (the GIL), hence the short sleeps. 1 s without a stable read means a wedged writer
# died mid-write (the block stays odd forever).
_READ_DEADLINE_S = 1.0


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
        size = OFF_RING + capacity * SLOT_SIZE
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        META.pack_into(
            self._map,
            OFF_META,
            MAGIC,
            PAGE_VERSION,
            capacity,
            SLOT_SIZE,
            os.getpid(),
            rank,
            world_size,
            local_rank,
            encode_name(job, 128),
            encode_name(node, 64),
            encode_name(pid_ns, 24),
        )
        self._seq = {OFF_STEP: 0, OFF_HEALTH: 0, OFF_LATER: 0}
        self._later_head = 0  # the ring head as of the newest op `publish_events` wrote
        self._live_seq = 0
        starting = STATE_CODES[schema.RankState.STARTING]
        self._live: list[object] = [starting, 0, -1, 0.0, 0.0, 0.0, 0, b"", b"", 0, 0]
        self._compiling = 0  # COMPILING while torch.compile compiles (`compiling()`)
        self._write_live()
        os.replace(tmp, self.path)  # readers never see a half-initialised page

    def _guarded(self, offset: int, packer: struct.Struct, *values: object) -> None:
        seq = self._seq[offset] + 1
        SEQ.pack_into(self._map, offset, seq)
        packer.pack_into(self._map, offset + 8, *values)
        self._seq[offset] = seq + 1
        SEQ.pack_into(self._map, offset, seq + 1)

    def _write_live(self) -> None:
        seq = self._live_seq + 1
        buf = self._map
        SEQ.pack_into(buf, OFF_LIVE, seq)
        LIVE.pack_into(buf, OFF_LIVE + 8, *self._live)
        self._live_seq = seq + 1
        SEQ.pack_into(buf, OFF_LIVE, seq + 1)

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
        live[0] = state_code(state)
        if checkpoint_done:
            live[1] = cast(int, live[1]) + 1
        if step is not None:
            live[2] = step
            live[5] = now_mono
        live[3], live[4] = now_mono, now_wall
        self._write_live()

    def compiling(self, on: bool) -> None:
        """torch.compile started (`on`) or finished compiling, in the training thread (the
        live block's writer). Not progress: the rank's position and times stay."""
        self._compiling = COMPILING if on else 0
        live = self._live
        live[10] = (cast(int, live[10]) & BETWEEN_STEPS) | self._compiling
        self._write_live()

    def step_begun(self, step: int, now_mono: float, now_wall: float) -> None:
        """`progress(COMPUTE, now_mono=..., now_wall=..., step=step)`, positional (the step
        boundary's hot path)."""
        live = self._live
        live[0] = COMPUTE
        live[2] = step
        live[3], live[4], live[5] = now_mono, now_wall, now_mono
        live[10] = self._compiling
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
        now_wall=...)`, in one call (the step boundary's hot path); the rank is then between
        steps until `step_begun`."""
        self._guarded(
            OFF_STEP, STEP, step, step_time_s, mfu, comm_wait_s, collective_s, now_wall, tokens,
            loss,
        )  # fmt: skip
        live = self._live
        live[0] = COMPUTE
        live[3], live[4] = now_mono, now_wall
        # A compile ends before the step that ran it does (`compiling.py`): none runs now.
        self._compiling = 0
        live[10] = BETWEEN_STEPS
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
        live[0] = IN_COLLECTIVE if entering else COMPUTE
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
        offset = OFF_RING + (index % capacity) * SLOT_SIZE
        version = (index // capacity) * 2 + 1
        SEQ.pack_into(buf, offset, version)
        SLOT.pack_into(buf, offset + 8, seq, step, nbytes, wall, wall, 0.0, group_b, op_b, dtype_b)
        SEQ.pack_into(buf, offset, version + 1)
        live = self._live
        live[9] = index + 1
        live[0] = IN_COLLECTIVE if entering else COMPUTE
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
                OFF_LATER, LATER, self._later_head, newest.seq, newest.group_b, newest.op_b,
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
        offset = OFF_RING + (index % self.capacity) * SLOT_SIZE
        version = (index // self.capacity) * 2 + 1
        SEQ.pack_into(self._map, offset, version)
        SLOT.pack_into(
            self._map, offset + 8, seq, step, nbytes, enqueue_s, start_s, end_s, group_b, op_b,
            dtype_b,
        )  # fmt: skip
        SEQ.pack_into(self._map, offset, version + 1)

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
            index, seq, step, nbytes, enqueue_s, start_s, end_s, encode_group(group),
            encode_op(op), encode_dtype(dtype),
        )  # fmt: skip
        # The ring head reaches readers with the next live-block write (the collective() call
        # that follows every write_event), saving one seqlocked write per collective.
        self._live[9] = index + 1

    def finish_event(self, index: int, end_s: float) -> None:
        """Fill in the completion time of an event written earlier (if its slot still holds it)."""
        offset = OFF_RING + (index % self.capacity) * SLOT_SIZE
        version = (index // self.capacity) * 2 + 2
        if SEQ.unpack_from(self._map, offset)[0] == version:
            F64.pack_into(self._map, offset + 8 + 40, end_s)

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
            OFF_STEP,
            STEP,
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
            OFF_HEALTH,
            HEALTH,
            health.internal_errors,
            health.dropped_records,
            health.ship_errors,
            health.queued_records,
            health.quarantined_batches,
        )

    def control(self) -> tuple[int, str]:
        """The latest control request (seq, kind) the agent wrote; seq 0 means none."""
        seq, kind = CONTROL.unpack_from(self._map, OFF_CONTROL)
        return int(seq), decode_name(kind)

    def control_seq(self) -> int:
        """The latest control request's seq alone (cheaper than `control()`)."""
        return int(ACK.unpack_from(self._map, OFF_CONTROL)[0])

    def ack(self, seq: int) -> None:
        ACK.pack_into(self._map, OFF_ACK, seq)

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
        if len(self._map) < OFF_RING or self._map[:8] != MAGIC:
            self._map.close()
            raise ValueError(f"{self.path} is not a vigil progress page (bad magic)")
        meta = META.unpack_from(self._map, OFF_META)
        if meta[1] != PAGE_VERSION:
            self._map.close()
            raise ValueError(f"{self.path}: page version {meta[1]}, expected {PAGE_VERSION}")
        (_, _, self.capacity, _, self.pid, self.rank, self.world_size, self.local_rank) = meta[:8]
        self.job, self.node, self.pid_ns = (
            decode_name(meta[8]),
            decode_name(meta[9]),
            decode_name(meta[10]),
        )

    def _read(self, offset: int, packer: struct.Struct) -> tuple[Any, ...]:
        deadline = 0.0
        while True:
            before = SEQ.unpack_from(self._map, offset)[0]
            if not before % 2:
                values = packer.unpack_from(self._map, offset + 8)
                if SEQ.unpack_from(self._map, offset)[0] == before:
                    return tuple(values)
            now = time.monotonic()
            deadline = deadline or now + _READ_DEADLINE_S
            if now > deadline:
                raise TimeoutError(f"{self.path}: page block at {offset} kept changing while read")
            time.sleep(0.0005)

    def snapshot(self) -> PageSnapshot:
        live = list(self._read(OFF_LIVE, LIVE))
        head, seq, group, op, mono, wall = self._read(OFF_LATER, LATER)
        if head > live[9]:  # an op published after its launch is the newest on the page ...
            live[9] = head
            if live[0] != IN_COLLECTIVE:  # ... and the rank's position, unless it is inside one
                live[6:9] = seq, group, op
                live[3], live[4] = max(live[3], mono), max(live[4], wall)
        step = self._read(OFF_STEP, STEP)
        health = self._read(OFF_HEALTH, HEALTH)
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
            last_group=decode_name(live[7]),
            last_op=decode_name(live[8]),
            ring_head=live[9],
            checkpoints=live[1],
            between_steps=bool(live[10] & BETWEEN_STEPS),
            compiling=bool(live[10] & COMPILING),
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
            offset = OFF_RING + (index % self.capacity) * SLOT_SIZE
            version = SEQ.unpack_from(self._map, offset)[0]
            if version != (index // self.capacity) * 2 + 2:
                yield None
                continue
            seq, step, nbytes, enq, start, end, group, op, dtype = SLOT.unpack_from(
                self._map, offset + 8
            )
            yield schema.CollectiveEvent(
                job_id=job,
                rank=self.rank,
                group=decode_name(group) or "?",
                seq=seq,
                op=decode_name(op) or "?",
                bytes=nbytes,
                dtype=decode_name(dtype),
                step=max(0, step),
                enqueue_s=enq,
                start_s=start,
                end_s=end,
            )

    def request_control(self, kind: str) -> int:
        """Ask the rank to run its `kind` callback at its next step boundary; returns the seq."""
        if not kind or len(kind.encode()) > 16:
            raise ValueError(f"control kind {kind!r} must be 1..16 bytes")
        seq = int(CONTROL.unpack_from(self._map, OFF_CONTROL)[0]) + 1
        CONTROL.pack_into(self._map, OFF_CONTROL, seq, kind.encode())
        return seq

    def acked(self) -> int:
        return int(ACK.unpack_from(self._map, OFF_ACK)[0])

    def close(self) -> None:
        self._map.close()
