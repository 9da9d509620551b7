"""The one codec every vigil part uses: msgpack batches (optionally zstd-compressed) and JSON lines.

A batch frame is `MAGIC + flags byte + payload`, the payload being a msgpack `schema.Batch`.
Step records travel as one columnar `schema.StepBlock` (schema v2): `decode_frame` hands them
on as `vigil.columns.StepColumns` (the collector's path), `decode_batch` as records.
Decoding is bounded (compressed size, decompressed size, record count) and every failure raises
`DecodeError`, which names the record type, the field and the problem. No I/O happens here.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import msgspec
import zstandard

from vigil import columns, schema

MAGIC = b"VGL"
FLAG_ZSTD = 0x01
_KNOWN_FLAGS = FLAG_ZSTD

# 32 MiB on the wire, 64 MiB inflated and 100,000 records: ten steps of a 10,000-rank job per
# batch (senders ship at most 5,000 records a batch), while one batch's decoded objects stay
# near 50 MB, so a few small hostile frames cannot exhaust a collector's memory.
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_DECOMPRESSED_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_RECORDS = 100_000
# zstd level 3 is zstd's own default: ~4x on step records at hundreds of MB/s per core.
ZSTD_LEVEL = 3

T = TypeVar("T")


class _BatchHead(msgspec.Struct, kw_only=True):
    """A batch with its records and step block left undecoded: decoded first, so the record
    count is known (from the msgpack array header) before any record is built."""

    v: int
    batch_id: schema.Name
    sent_s: schema.NonNegFloat = 0.0
    source: schema.Text = ""
    records: msgspec.Raw = msgspec.Raw(b"\x90")  # an empty msgpack array
    steps: schema.StepBlock | None = None


_msgpack_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(_BatchHead)
_records_decoder = msgspec.msgpack.Decoder(list[schema.Record])
_json_encoder = msgspec.json.Encoder()
_record_json_decoder = msgspec.json.Decoder(schema.Record)
_PATH_RE = re.compile(r"^\$(?:\.records)?\[(\d+)\](?:\.(.*))?$")


class DecodeError(ValueError):
    """A payload could not be decoded; says which record type, which field and what was wrong."""

    def __init__(self, record_type: str, field: str, problem: str) -> None:
        self.record_type = record_type
        self.field = field
        self.problem = problem
        super().__init__(f"{record_type}.{field}: {problem}")


def new_batch_id() -> str:
    """A fresh idempotency key for one shipment."""
    return uuid.uuid4().hex


def encode_batch(
    records: Sequence[schema.Record],
    *,
    batch_id: str | None = None,
    source: str = "",
    compress: bool = True,
    sent_s: float | None = None,
) -> bytes:
    """Frame `records` into one batch; `batch_id` defaults to a fresh one. Step records go
    into the columnar block (unless one holds an integer too large for it)."""
    rest = list(records)
    block = None
    step_records = [r for r in rest if type(r) is schema.StepRecord]
    if step_records:
        block = columns.to_block(step_records)
        if block is not None:
            rest = [r for r in rest if type(r) is not schema.StepRecord]
    batch = schema.Batch(
        v=schema.SCHEMA_VERSION,
        batch_id=batch_id or new_batch_id(),
        sent_s=time.time() if sent_s is None else sent_s,
        source=source,
        records=rest,
        steps=block,
    )
    payload = _msgpack_encoder.encode(batch)
    if compress:
        payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(payload)
        return MAGIC + bytes([FLAG_ZSTD]) + payload
    return MAGIC + b"\x00" + payload


def decode_batch(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
    max_records: int = DEFAULT_MAX_RECORDS,
) -> schema.Batch:
    """Decode one frame from `encode_batch`, step records included in `records` (after the
    others); raises DecodeError on anything malformed."""
    batch, steps = decode_frame(
        data,
        max_bytes=max_bytes,
        max_decompressed_bytes=max_decompressed_bytes,
        max_records=max_records,
    )
    if steps is not None:
        batch.records.extend(columns.to_records(steps))
        batch.steps = None
    return batch


def decode_frame(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
    max_records: int = DEFAULT_MAX_RECORDS,
) -> tuple[schema.Batch, columns.StepColumns | None]:
    """Decode one frame, leaving its step block as checked columns (None: no block) rather
    than building a record per step; raises DecodeError on anything malformed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError("Batch", "<frame>", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise DecodeError(
            "Batch", "<frame>", f"{len(data)} bytes exceeds the {max_bytes} byte limit"
        )
    if len(data) < len(MAGIC) + 1 or bytes(data[: len(MAGIC)]) != MAGIC:
        raise DecodeError("Batch", "<frame>", "not a vigil batch (bad magic bytes or truncated)")
    flags = data[len(MAGIC)]
    if flags & ~_KNOWN_FLAGS:
        raise DecodeError("Batch", "<frame>", f"unknown frame flags 0x{flags:02x}")
    payload = bytes(data[len(MAGIC) + 1 :])
    if flags & FLAG_ZSTD:
        payload = _decompress(payload, max_decompressed_bytes)
    try:
        head = _head_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _explain(payload, exc) from exc
    if head.v not in schema.SUPPORTED_VERSIONS:
        raise _wrong_version(head.v)
    count = _array_length(head.records)
    if head.steps is not None:
        # Bounded before unpacking: 8 bytes per value, at least the required columns.
        count += len(head.steps.values) // (8 * max(len(head.steps.fields), 1))
    if count > max_records:
        raise DecodeError("Batch", "records", f"{count} records exceeds the {max_records} limit")
    try:
        records = _records_decoder.decode(head.records)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _explain(head.records, exc, records=True) from exc
    batch = schema.Batch(
        v=head.v,
        batch_id=head.batch_id,
        sent_s=head.sent_s,
        source=head.source,
        records=records,
        steps=head.steps,
    )
    steps = None
    if batch.steps is not None:
        try:
            steps = columns.from_block(batch.steps)
        except columns.BlockError as exc:
            raise DecodeError("StepRecord", exc.field, exc.problem) from exc
    return batch, steps


# A frames envelope (`encode_frames`): each frame behind its length, 4 bytes big-endian.
_FRAME_LENGTH_BYTES = 4


def encode_frames(frames: Sequence[bytes]) -> bytes:
    """Several batch frames as one body (`api.INGEST_FRAMES_PATH`), each left as framed."""
    parts: list[bytes] = []
    for frame in frames:
        parts += [len(frame).to_bytes(_FRAME_LENGTH_BYTES, "big"), frame]
    return b"".join(parts)


def split_frames(body: bytes, *, max_frames: int) -> list[bytes]:
    """The frames of an `encode_frames` body (not decoded); DecodeError when it is cut short,
    holds an empty frame or more than `max_frames` frames."""
    frames: list[bytes] = []
    view = memoryview(body)
    at = 0
    while at < len(view):
        if len(frames) == max_frames:
            raise DecodeError("Frames", "<frames>", f"more than the limit of {max_frames} frames")
        head = view[at : at + _FRAME_LENGTH_BYTES]
        if len(head) < _FRAME_LENGTH_BYTES:
            raise DecodeError("Frames", f"[{len(frames)}]", "cut short inside a frame's length")
        size = int.from_bytes(head, "big")
        at += _FRAME_LENGTH_BYTES
        if size == 0 or at + size > len(view):
            problem = "is empty" if size == 0 else f"declares {size} bytes, {len(view) - at} remain"
            raise DecodeError("Frames", f"[{len(frames)}]", problem)
        frames.append(bytes(view[at : at + size]))
        at += size
    if not frames:
        raise DecodeError("Frames", "<frames>", "holds no frame")
    return frames


def _array_length(raw: msgspec.Raw) -> int:
    """Elements of the msgpack array `raw` holds, from its header alone (0: not an array, which
    decoding it then reports)."""
    head = memoryview(raw)[:5]
    first = head[0] if len(head) else 0
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first == 0xDC and len(head) >= 3:
        return int.from_bytes(head[1:3], "big")
    if first == 0xDD and len(head) >= 5:
        return int.from_bytes(head[1:5], "big")
    return 0


def inflated_size(data: bytes) -> int:
    """How many bytes a frame's payload inflates to, as far as its header says (-1: it does not
    say, a streamed zstd frame or not a frame); costs nothing, decompresses nothing."""
    if len(data) < len(MAGIC) + 1 or bytes(data[: len(MAGIC)]) != MAGIC:
        return -1
    if not data[len(MAGIC)] & FLAG_ZSTD:
        return len(data) - len(MAGIC) - 1
    try:
        return int(zstandard.frame_content_size(bytes(data[len(MAGIC) + 1 : len(MAGIC) + 19])))
    except zstandard.ZstdError:
        return -1


def _decompress(payload: bytes, limit: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(payload)  # -1: the frame does not say
    except zstandard.ZstdError as exc:
        raise DecodeError("Batch", "<frame>", f"corrupt zstd payload: {exc}") from exc
    if declared > limit:
        raise DecodeError("Batch", "<frame>", f"decompresses beyond the {limit} byte limit")
    if declared > 0:  # one shot into a buffer of the declared size (zstd checks it): 2x faster
        try:
            return bytes(zstandard.ZstdDecompressor().decompress(payload))
        except zstandard.ZstdError as exc:
            raise DecodeError("Batch", "<frame>", f"corrupt zstd payload: {exc}") from exc
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(payload)
        out = reader.read(limit + 1)
        # A frame may hold more data than one read returns; keep reading up to the limit.
        chunks = [out]
        total = len(out)
        while out and total <= limit:
            out = reader.read(limit + 1 - total)
            chunks.append(out)
            total += len(out)
    except zstandard.ZstdError as exc:
        raise DecodeError("Batch", "<frame>", f"corrupt zstd payload: {exc}") from exc
    if total > limit:
        raise DecodeError("Batch", "<frame>", f"decompresses beyond the {limit} byte limit")
    if total == 0:
        raise DecodeError("Batch", "<frame>", "empty or truncated zstd payload")
    return b"".join(chunks)


def _wrong_version(version: object) -> DecodeError:
    return DecodeError(
        "Batch",
        "v",
        f"schema version {version!r} is not supported (this vigil speaks "
        f"{', '.join(map(str, sorted(schema.SUPPORTED_VERSIONS)))})",
    )


def _explain(payload: bytes | msgspec.Raw, exc: Exception, *, records: bool = False) -> DecodeError:
    """Turn a msgspec error into a DecodeError that names record type and field (`records`:
    `payload` is the batch's record array, already counted, rather than the whole batch)."""
    if not isinstance(exc, msgspec.ValidationError):  # malformed or truncated bytes
        return DecodeError("Batch", "records" if records else "<payload>", str(exc))
    message, _, path = str(exc).partition(" - at `")
    path = path.rstrip("`")
    if not records:
        try:
            version = msgspec.msgpack.decode(payload, type=_Version).v
        except (msgspec.DecodeError, msgspec.ValidationError):
            version = schema.SCHEMA_VERSION
        if version not in schema.SUPPORTED_VERSIONS:
            return _wrong_version(version)
    match = _PATH_RE.match(path)
    if match is None:
        field = path.removeprefix("$.") if path.startswith("$.") else "<payload>"
        return DecodeError("Batch", "records" if records else (field or "<payload>"), message)
    index, field = int(match.group(1)), match.group(2) or "<record>"
    return DecodeError(_record_type_at(payload, index), field, message)


def _record_type_at(records: bytes | msgspec.Raw, index: int) -> str:
    """The type tag of record `index` of a record array, decoding only that record's tag."""
    try:
        tags = msgspec.msgpack.decode(records, type=list[_Tag])
        tag = tags[index].type
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
        return "Record"
    cls = schema.RECORD_TAGS.get(tag) if isinstance(tag, str) else None
    return cls.__name__ if cls is not None else f"Record(type={tag!r})"


class _Version(msgspec.Struct):
    """Only a batch's schema version (the rest is skipped)."""

    v: Any = schema.SCHEMA_VERSION


class _Tag(msgspec.Struct):
    """Only a record's `type` tag (the rest is skipped)."""

    type: Any = None


def encode_json(record: schema.Record) -> bytes:
    """One record as a JSON object (the JSONL line format, without the newline)."""
    return _json_encoder.encode(record)


def encode_json_lines(records: Iterable[schema.Record]) -> bytes:
    """Records as newline-delimited JSON."""
    return _json_encoder.encode_lines(list(records))


def decode_json(line: bytes | str) -> schema.Record:
    """One JSONL line back into its record; raises DecodeError naming type and field."""
    try:
        return _record_json_decoder.decode(line)
    except msgspec.ValidationError as exc:
        message, _, path = str(exc).partition(" - at `")
        path = path.rstrip("`").removeprefix("$").removeprefix(".")
        try:
            tag = msgspec.json.decode(line).get("type")
        except (msgspec.DecodeError, AttributeError):
            tag = None
        cls = schema.RECORD_TAGS.get(tag) if isinstance(tag, str) else None
        name = cls.__name__ if cls is not None else "Record"
        raise DecodeError(name, path or "<record>", message) from exc
    except msgspec.DecodeError as exc:
        raise DecodeError("Record", "<line>", str(exc)) from exc


def decode_as(data: bytes, type_: type[T]) -> T:
    """Decode msgpack bytes into `type_` (used for control messages and single structs)."""
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        message, _, path = str(exc).partition(" - at `")
        field = path.rstrip("`").removeprefix("$").removeprefix(".") or "<payload>"
        raise DecodeError(getattr(type_, "__name__", str(type_)), field, message) from exc


def encode(obj: Any) -> bytes:
    """Plain msgpack encoding of a Struct (or builtins) with the shared encoder."""
    return _msgpack_encoder.encode(obj)
