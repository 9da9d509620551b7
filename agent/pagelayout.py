"""The progress page's layout: where each block of a rank's page sits and how it is packed, the
values read from it, and where pages live (per-run folders, `rundir.py` names and removes them).
The page itself is written and read in `progress.py`.

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
op. This module owns the layout and nothing else: no mmap, no torch, no threads, no network.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from pathlib import Path
from typing import NamedTuple

from vigil import schema

MAGIC = b"VGLPAGE1"
PAGE_VERSION = 1
PAGE_SUFFIX = ".page"

# The PID namespace (`readlink /proc/self/ns/pid`) sits in what was padding: older pages read "".
META = struct.Struct("<8sIIIIIII4x128s64s24s")
# state, checkpoints, last step, progress mono/wall, step start mono, last seq, last group, last
# op, ring head, flags (`BETWEEN_STEPS`, `COMPILING`). The checkpoint count (checkpoint spans
# finished) sits in what was padding, the flags byte after the ring head in what was too: older
# pages read 0 for both.
LIVE = struct.Struct("<BxxxIqdddQ32s24sQB")
# Flags: the training thread ended a step and has not begun the next; torch.compile is
# compiling in this process (`compiling.py`).
BETWEEN_STEPS = 1
COMPILING = 2
STEP = struct.Struct("<qdddddqd")
HEALTH = struct.Struct("<QQQQQ")
CONTROL = struct.Struct("<Q16s")
ACK = struct.Struct("<Q")
SLOT = struct.Struct("<QqQddd32s24s16s")
SEQ = struct.Struct("<Q")
F64 = struct.Struct("<d")
# ring head, last seq, last group, last op, progress mono/wall (`publish_events`)
LATER = struct.Struct("<QQ32s24sdd")

OFF_META = 0
OFF_LIVE = 256
OFF_STEP = 384
OFF_HEALTH = 512
OFF_CONTROL = 576
OFF_ACK = 608
OFF_LATER = 640
OFF_RING = 1024
SLOT_SIZE = 128

STATE_CODES: dict[schema.RankState, int] = {s: i for i, s in enumerate(schema.RankState)}
CODE_STATES: dict[int, schema.RankState] = {i: s for s, i in STATE_CODES.items()}
# Enum members hash through a Python-level __hash__; the hot paths look members up by identity.
_CODES_BY_ID: dict[int, int] = {id(s): i for s, i in STATE_CODES.items()}
IN_COLLECTIVE = STATE_CODES[schema.RankState.IN_COLLECTIVE]
COMPUTE = STATE_CODES[schema.RankState.COMPUTE]


def state_code(state: schema.RankState) -> int:
    code = _CODES_BY_ID.get(id(state))
    return STATE_CODES[state] if code is None else code


assert OFF_LIVE + 8 + LIVE.size <= OFF_STEP
assert OFF_STEP + 8 + STEP.size <= OFF_HEALTH
assert OFF_HEALTH + 8 + HEALTH.size <= OFF_CONTROL
assert OFF_CONTROL + CONTROL.size <= OFF_ACK
assert OFF_ACK + ACK.size <= OFF_LATER and OFF_LATER + 8 + LATER.size <= OFF_RING
assert 8 + SLOT.size <= SLOT_SIZE


def page_path(progress_dir: Path, job: str, rank: int, run_id: str | None = None) -> Path:
    """Rank `rank`'s page of run `run_id` of `job` (`<root>/<job>/<run>/`, see `rundir.py`);
    without a run id, the newest run's page of that rank that exists (FileNotFoundError if none)."""
    name = f"rank-{rank:05d}{PAGE_SUFFIX}"
    if run_id is not None:
        return Path(progress_dir) / job / run_id / name
    found = sorted(Path(progress_dir).glob(f"{glob_escape(job)}/*/{name}"), key=mtime)
    if not found:
        raise FileNotFoundError(f"no page of rank {rank} of job {job!r} under {progress_dir}")
    return found[-1]


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def mtime(path: Path) -> float:
    """`path`'s modification time, 0 for one that is gone (a page or folder removed meanwhile)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def decode_name(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


@functools.lru_cache(maxsize=4096)  # group/op/dtype names repeat: encode each once
def encode_name(text: str, size: int) -> bytes:
    return text.encode("utf-8")[:size]


def encode_group(name: str) -> bytes:
    """A process group's name as the page stores it (callers on hot paths encode once)."""
    return encode_name(name, 32)


def encode_op(op: str) -> bytes:
    return encode_name(op, 24)


def encode_dtype(dtype: str) -> bytes:
    return encode_name(dtype, 16)


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
    # Between steps: the training thread ended a step and has not begun the next (user code
    # vigil does not time: an evaluation, a save, the data loader of a loop that loads outside
    # its step); the hang checks give such silence the start-up grace.
    between_steps: bool = False
    # torch.compile is compiling (a recompilation mid-run takes seconds to minutes inside a
    # step): the hang checks give that silence the start-up grace too.
    compiling: bool = False
    health: Health


def discover(progress_dir: Path, job: str | None = None) -> list[Path]:
    """Every rank page under `progress_dir` (`<job>/<run>/rank-NNNNN.page`), or `job`'s alone."""
    root = Path(progress_dir)
    if not root.is_dir():
        return []
    return sorted(root.glob(f"{'*' if job is None else glob_escape(job)}/*/*{PAGE_SUFFIX}"))
