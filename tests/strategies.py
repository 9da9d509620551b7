"""Hypothesis strategies for every wire record, derived from the schema's own type info.

Deriving from msgspec.inspect keeps the strategies honest when the schema grows: a new field or
constraint is generated without editing this file.
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

from vigil import schema

_MAX_INT = 2**53  # keeps values exact through JSON as well as msgpack


def for_type(info: mi.Type) -> st.SearchStrategy[Any]:
    if isinstance(info, mi.IntType):
        lo = info.ge if info.ge is not None else -_MAX_INT
        return st.integers(min_value=lo, max_value=_MAX_INT)
    if isinstance(info, mi.FloatType):
        return st.floats(
            min_value=info.ge, max_value=info.le, allow_nan=False, allow_infinity=False
        )
    if isinstance(info, mi.StrType):
        return st.text(min_size=info.min_length or 0, max_size=min(info.max_length or 40, 40))
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.EnumType):
        return st.sampled_from(list(info.cls))
    if isinstance(info, mi.ListType):
        return st.lists(for_type(info.item_type), max_size=4)
    if isinstance(info, mi.UnionType):
        return st.one_of(*(for_type(t) for t in info.types))
    if isinstance(info, mi.StructType):
        return for_struct(info.cls)
    raise NotImplementedError(f"no strategy for {info!r}")


def for_struct(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = {f.name: for_type(f.type) for f in info.fields}

    def build(values: dict[str, Any]) -> Any:
        try:
            return cls(**values)
        except ValueError:  # a cross-field rule (e.g. end_s before start_s)
            return None

    return st.fixed_dictionaries(fields).map(build).filter(lambda r: r is not None)


any_record = st.one_of(*(for_struct(t) for t in schema.RECORD_TYPES))
