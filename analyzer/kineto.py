"""Kineto / Chrome trace import: torch.profiler output (one file per rank, .json or .json.gz).

Decoding is typed and selective (msgspec Structs that keep only the fields the analyses use), so
a trace costs a fraction of the memory of a generic JSON load. Events are selected the way
HolisticTraceAnalysis selects them, so figures agree with it: complete events with a duration
and a category (not "Trace"); GPU events are those with an integer `stream` and a non-negative
`correlation`; with two or more `ProfilerStep#N` annotations the last, possibly incomplete, step
is dropped together with the GPU events its CPU side launched; nanosecond-resolution (float)
timestamps are rounded inward to whole microseconds (start up, end down).

Pure parsing over bytes or a path; a corrupt file raises `TraceError` naming file and reason.
"""

from __future__ import annotations

import array
import ast
import gzip
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

# Kernel classes, as HolisticTraceAnalysis defines them.
COMMUNICATION, MEMORY, COMPUTATION, OTHER = 0, 1, 2, 3
KERNEL_TYPE_NAMES = ("communication", "memory", "computation", "other")
_COMM_RE = re.compile(r"^nccl.*Kernel")
_MEMORY_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


class TraceError(ValueError):
    """A trace file could not be read; names the file and why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class _Args(msgspec.Struct, gc=False):
    stream: int | str | None = None
    correlation: int | None = None
    collective: Any = msgspec.field(default=None, name="Collective name")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    group_size: Any = msgspec.field(default=None, name="Group size")
    dtype: Any = None
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    pg_desc: Any = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")


class _LenientArgs(_Args, gc=False):
    stream: Any = None
    correlation: Any = None


class _Event(msgspec.Struct, gc=False):
    cat: str | None = None
    name: str = ""
    ts: float | None = None
    dur: float | None = None
    args: _Args | None = None


class _LenientEvent(msgspec.Struct, gc=False):
    cat: Any = None
    name: Any = ""
    ts: float | None = None
    dur: float | None = None
    args: _LenientArgs | None = None


class _TraceFile(msgspec.Struct):
    # Events stay raw JSON (views into the buffer) and are decoded in chunks, so only one
    # chunk of event objects exists at a time: this keeps peak memory near the file size.
    traceEvents: list[msgspec.Raw] = msgspec.field(default_factory=list)  # noqa: N815
    distributedInfo: Any = None  # noqa: N815


_CHUNK = 1024
_chunk_decoder = msgspec.json.Decoder(list[_Event])
_lenient_decoder = msgspec.json.Decoder(list[_LenientEvent])


def kernel_type(name: str) -> int:
    """HolisticTraceAnalysis' kernel classes: communication, memory, computation or other."""
    if _COMM_RE.match(name):
        return COMMUNICATION
    if _MEMORY_RE.match(name):
        return MEMORY
    if not _NOT_COMPUTE_RE.match(name):
        return COMPUTATION
    return OTHER


@dataclass(frozen=True, kw_only=True)
class NcclMeta:
    """What a NCCL kernel says about its collective (from its args or, failing that, its name)."""

    op: str
    algorithm: str = ""
    protocol: str = ""
    dtype: str = ""
    in_nelems: int = -1
    out_nelems: int = -1
    group: str = ""
    group_desc: str = ""
    group_size: int = -1
    group_ranks: str = ""

    @property
    def bytes(self) -> int:
        size = _DTYPE_BYTES.get(self.dtype.lower(), 0)
        return max(self.in_nelems, self.out_nelems) * size if size and self.in_nelems >= 0 else -1


_DTYPE_BYTES = {
    "float": 4,
    "f32": 4,
    "float32": 4,
    "half": 2,
    "f16": 2,
    "float16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "double": 8,
    "f64": 8,
    "int": 4,
    "i32": 4,
    "int32": 4,
    "long": 8,
    "i64": 8,
    "int64": 8,
    "byte": 1,
    "char": 1,
    "int8_t": 1,
    "i8": 1,
    "u8": 1,
    "uint8_t": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
_ALGOS = {"RING", "TREE", "COLLNET", "COLLNETDIRECT", "COLLNETCHAIN", "NVLS", "NVLSTREE", "PAT"}
_PROTOS = {"LL", "LL128", "SIMPLE"}
_REDOPS = {"Sum", "Prod", "Max", "Min", "PreMulSum", "SumPostDiv"}


def parse_nccl_name(name: str) -> NcclMeta:
    """Op, algorithm, protocol and dtype from old (`ncclKernel_AllReduce_RING_LL_Sum_float`) and
    new (`ncclDevKernel_AllReduce_Sum_f32_RING_LL`) NCCL kernel names."""
    head = name.split("(", 1)[0]
    head = re.sub(r"^nccl(Dev)?Kernel_?", "", head)
    parts = [p for p in head.split("_") if p]
    op = parts[0] if parts else "Unknown"
    algo = next((p for p in parts[1:] if p.upper() in _ALGOS), "")
    proto = next((p for p in parts[1:] if p.upper() in _PROTOS), "")
    rest = [p for p in parts[1:] if p.upper() not in _ALGOS | _PROTOS and p not in _REDOPS]
    dtype = "_".join(rest)
    return NcclMeta(op=op, algorithm=algo, protocol=proto, dtype=dtype)


def _meta(name: str, args: _Args | None) -> NcclMeta:
    base = parse_nccl_name(name)
    if args is None or args.collective is None:
        return base
    return NcclMeta(
        op=str(args.collective),
        algorithm=base.algorithm,
        protocol=base.protocol,
        dtype=str(args.dtype or base.dtype),
        in_nelems=_int(args.in_nelems),
        out_nelems=_int(args.out_nelems),
        group=str(args.pg_name or ""),
        group_desc=str(args.pg_desc or ""),
        group_size=_int(args.group_size),
        group_ranks=str(args.pg_ranks or ""),
    )


def _int(value: Any, default: int = -1) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


@dataclass(kw_only=True)
class KinetoTrace:
    """One rank's GPU kernels (HTA-filtered) as arrays, microseconds."""

    path: str
    rank: int
    world_size: int
    backend: str
    ts: npt.NDArray[np.float64]
    end: npt.NDArray[np.float64]
    stream: npt.NDArray[np.int64]
    ktype: npt.NDArray[np.int8]
    name_id: npt.NDArray[np.int32]
    names: list[str]
    nccl: dict[int, NcclMeta] = field(default_factory=dict)  # kernel index -> metadata
    profiler_steps: list[tuple[int, float, float]] = field(default_factory=list)
    num_events: int = 0
    has_gpu: bool = True


def read_bytes(path: str | Path) -> bytes | memoryview:
    """The file's JSON bytes, gunzipped when it ends in .gz.

    A gzip file is inflated straight into one buffer sized from its trailer (ISIZE), so peak
    memory is the inflated size rather than twice it.
    """
    p = Path(path)
    try:
        if p.suffix != ".gz":
            return p.read_bytes()
        with p.open("rb") as raw:
            raw.seek(-4, 2)
            size = int.from_bytes(raw.read(4), "little")
            raw.seek(0)
            buf = bytearray(size + 1)  # one spare byte tells a wrong trailer (>4 GiB, multi-member)
            view = memoryview(buf)
            with gzip.GzipFile(fileobj=raw) as gz:
                filled = 0
                # Small reads: one huge read would inflate into a temporary as large as `buf`.
                while filled < len(buf) and (n := gz.readinto(view[filled : filled + 2**20])):
                    filled += n
                if filled <= size:
                    return view[:filled]
                return bytes(buf[:filled]) + gz.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(str(p), f"cannot read ({type(exc).__name__}: {exc})") from exc


def load(path: str | Path, *, rank: int | None = None) -> KinetoTrace:
    """Read and select one rank's trace; raises TraceError on a corrupt or truncated file."""
    return parse(read_bytes(path), path=str(path), rank=rank)


def parse(
    data: bytes | memoryview, *, path: str = "<bytes>", rank: int | None = None
) -> KinetoTrace:
    try:
        doc = msgspec.json.decode(data, type=_TraceFile)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceError(path, f"not a Kineto/Chrome trace ({exc})") from exc
    if not doc.traceEvents:
        raise TraceError(path, "no traceEvents")
    info = _distributed_info(doc.distributedInfo)
    if rank is None:
        rank = _int(info.get("rank"), -1)
    if rank < 0:
        match = _RANK_IN_NAME.search(Path(path).name)
        rank = int(match.group(1)) if match else 0
    return _select(
        doc.traceEvents, path, rank, _int(info.get("world_size"), 0), str(info.get("backend", ""))
    )


def _distributed_info(raw: Any) -> dict[str, Any]:
    """distributedInfo is a JSON object in most traces and a Python repr string in some."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return {}
        return value if isinstance(value, dict) else {}
    return {}


class _Selection:
    """What the event pass keeps: GPU events, CPU-side correlations and profiler steps."""

    def __init__(self) -> None:
        self.gpu: list[tuple[float, float, int, int, str, _Args | None]] = []
        self.cpu_ts = array.array("d")  # compact: a trace has tens of thousands of launches
        self.cpu_corr = array.array("q")
        self.steps: list[tuple[int, float, float]] = []
        self.fractional = False

    def add(self, events: list[_Event] | list[_LenientEvent]) -> None:
        gpu, cpu_ts, cpu_corr = self.gpu, self.cpu_ts, self.cpu_corr
        for e in events:
            ts, dur, cat = e.ts, e.dur, e.cat
            if dur is None or ts is None or cat is None or cat == "Trace":
                continue
            if not self.fractional and (ts % 1 or dur % 1):
                self.fractional = True
            args = e.args
            stream = corr = -1
            if args is not None:
                raw_stream, raw_corr = args.stream, args.correlation
                # The fast path is a plain int; None and strings are rare.
                stream = raw_stream if type(raw_stream) is int else _int(raw_stream)
                corr = raw_corr if type(raw_corr) is int else _int(raw_corr)
            name = e.name if isinstance(e.name, str) else str(e.name)
            if stream >= 0 and corr >= 0:
                gpu.append((ts, dur, stream, corr, name, args))
                continue
            if corr >= 0:
                cpu_ts.append(ts)
                cpu_corr.append(corr)
            if "ProfilerStep" in name:
                m = re.search(r"ProfilerStep\s*#\s*(\d+)", name)
                self.steps.append((int(m.group(1)) if m else len(self.steps), ts, ts + dur))


def _select(
    events: list[msgspec.Raw], path: str, rank: int, world: int, backend: str
) -> KinetoTrace:
    kept = _Selection()
    for i in range(0, len(events), _CHUNK):
        chunk = b"[" + b",".join(events[i : i + _CHUNK]) + b"]"
        try:
            kept.add(_chunk_decoder.decode(chunk))
        except msgspec.ValidationError:  # odd types somewhere: take the chunk leniently
            try:
                kept.add(_lenient_decoder.decode(chunk))
            except msgspec.ValidationError as exc:
                raise TraceError(path, f"malformed trace event ({exc})") from exc
    gpu = kept.gpu
    if len(kept.steps) >= 2:
        last_start = max(s[1] for s in kept.steps)
        launched = {c for t, c in zip(kept.cpu_ts, kept.cpu_corr, strict=True) if t < last_start}
        gpu = [g for g in gpu if g[3] in launched]
    return _arrays(
        gpu, path, rank, world, backend, sorted(kept.steps), kept.fractional, len(events)
    )


def _arrays(
    gpu: list[tuple[float, float, int, int, str, _Args | None]],
    path: str,
    rank: int,
    world: int,
    backend: str,
    steps: list[tuple[int, float, float]],
    fractional: bool,
    num_events: int,
) -> KinetoTrace:
    gpu.sort(key=lambda g: g[0])
    names: list[str] = []
    ids: dict[str, int] = {}
    name_id = np.empty(len(gpu), dtype=np.int32)
    ktype = np.empty(len(gpu), dtype=np.int8)
    types: list[int] = []
    nccl: dict[int, NcclMeta] = {}
    for i, g in enumerate(gpu):
        nid = ids.get(g[4])
        if nid is None:
            nid = ids[g[4]] = len(names)
            names.append(g[4])
            types.append(kernel_type(g[4]))
        name_id[i] = nid
        ktype[i] = types[nid]
        if types[nid] == COMMUNICATION:
            nccl[i] = _meta(g[4], g[5])
    ts = np.fromiter((g[0] for g in gpu), dtype=np.float64, count=len(gpu))
    dur = np.fromiter((g[1] for g in gpu), dtype=np.float64, count=len(gpu))
    end = ts + dur
    if fractional:  # HTA's rounding for ns-resolution traces (see pytorch PR 122425)
        ts, end = np.ceil(ts), np.floor(end)
    return KinetoTrace(
        path=path,
        rank=rank,
        world_size=world,
        backend=backend,
        ts=ts,
        end=end,
        stream=np.fromiter((g[2] for g in gpu), dtype=np.int64, count=len(gpu)),
        ktype=ktype,
        name_id=name_id,
        names=names,
        nccl=nccl,
        profiler_steps=steps,
        num_events=num_events,
        has_gpu=bool(gpu),
    )


__all__ = [
    "KinetoTrace",
    "NcclMeta",
    "TraceError",
    "kernel_type",
    "load",
    "parse",
    "parse_nccl_name",
]
