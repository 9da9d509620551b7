"""PostgreSQL's binary COPY format written from numpy columns, with no Python pass per row.

psycopg's `write_row` formats one tuple at a time (about 1 µs a field); step records arrive as
columns already (`vigil.columns`), so their COPY stream is laid out with numpy structured
arrays instead. Binary COPY is a signature, then per row a big-endian field count and per field
a length (-1: NULL) and its bytes, then a trailer. Rows with the same text values and the same
NULL pattern have one layout, so each such group is one structured array; groups follow each
other (row order inside a COPY does not matter to a table). Meant for columns with few
distinct text values (a batch's job names). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
TRAILER = b"\xff\xff"
# PostgreSQL type name -> big-endian numpy format of its binary representation.
_FORMATS = {"int8": ">i8", "int4": ">i4", "int2": ">i2", "float8": ">f8", "float4": ">f4"}

Column = npt.NDArray[np.float64] | npt.NDArray[np.int64] | Sequence[str]


def encode(
    types: Sequence[str],
    values: Sequence[Column],
    nulls: Sequence[npt.NDArray[np.bool_] | None],
) -> bytes:
    """The whole binary COPY stream of rows given as columns: `types[i]` is column i's
    PostgreSQL type (text or a fixed-size number), `values[i]` its values (numbers are cast to
    the type), `nulls[i]` where it is NULL (None: nowhere)."""
    if not (len(types) == len(values) == len(nulls)):
        raise ValueError("types, values and nulls must describe the same columns")
    unknown = sorted({t for t in types if t != "text" and t not in _FORMATS})
    if unknown:
        raise ValueError(f"binary COPY of {', '.join(unknown)} is not supported here")
    n = len(values[0]) if values else 0
    if any(len(v) != n for v in values):
        raise ValueError("every column must hold one value per row")
    if n == 0:
        return SIGNATURE + TRAILER
    # One integer code per row for its layout: which text value each text column holds, and
    # which nullable columns are NULL.
    code = np.zeros(n, dtype=np.int64)
    for i, (kind, column) in enumerate(zip(types, values, strict=True)):
        if kind == "text":
            index: dict[object, int] = dict.fromkeys(column, 0)
            if len(index) > 1:
                index = {value: k for k, value in enumerate(index)}
                which = np.fromiter(map(index.__getitem__, column), dtype=np.int64, count=n)
                code = code * len(index) + which
        mask = nulls[i]
        if mask is not None:
            code = code * 2 + np.asarray(mask, dtype=np.int64)
    order = np.argsort(code, kind="stable")
    sorted_codes = code[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_codes[1:] != sorted_codes[:-1])))
    ends = np.concatenate((starts[1:], [n]))
    parts = [SIGNATURE]
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        rows = order[start:end]
        parts.append(_group(types, values, nulls, rows).tobytes())
    parts.append(TRAILER)
    return b"".join(parts)


def _group(
    types: Sequence[str],
    values: Sequence[Column],
    nulls: Sequence[npt.NDArray[np.bool_] | None],
    rows: npt.NDArray[np.intp],
) -> npt.NDArray[np.void]:
    """The rows `rows` (all of one layout) as a packed structured array."""
    first = int(rows[0])
    names, formats = ["count"], [">i2"]
    fills: list[tuple[str, object]] = [("count", len(types))]
    for i, kind in enumerate(types):
        mask = nulls[i]
        if mask is not None and bool(mask[first]):
            names.append(f"len{i}")
            formats.append(">i4")
            fills.append((f"len{i}", -1))
            continue
        if kind == "text":
            column = values[i]
            text = str(column[first]).encode()
            names += [f"len{i}", f"val{i}"]
            formats += [">i4", f"S{len(text)}" if text else "V0"]
            fills += [(f"len{i}", len(text)), (f"val{i}", text)]
        else:
            fmt = _FORMATS[kind]
            names += [f"len{i}", f"val{i}"]
            formats += [">i4", fmt]
            fills += [(f"len{i}", np.dtype(fmt).itemsize), (f"val{i}", _cast(values[i], fmt, rows))]
    out = np.empty(len(rows), dtype=np.dtype({"names": names, "formats": formats}))
    for name, value in fills:
        if isinstance(value, bytes) and not value:
            continue  # an empty text value has no bytes to place
        out[name] = value
    return out


def _cast(column: Column, fmt: str, rows: npt.NDArray[np.intp]) -> npt.NDArray[np.generic]:
    picked = np.asarray(column)[rows]
    if fmt.lstrip(">").startswith("i") and picked.dtype.kind == "f":
        return picked.astype(np.int64).astype(fmt)  # whole numbers carried as float64
    return picked.astype(fmt)
