"""Process-group labels: what a collective's group is called in step records and heartbeats.

A group's name on the wire is `<label>:<id>`: `label` says what the group is (its parallel
dimension: `tp`, `dp`, `pp`, `dp_cp`, ...), `id` is torch's `group_name`, unique per group and
equal on every member, so each of a job's TP groups is `tp:<its id>` and the analyzer compares
groups of one label with each other (analyzer/links.py) and says "the tp group of node-3".

Where a label comes from, first match wins:
- `label_group(pg, "tp")`, the public SDK call for groups a user creates by hand (and what
  `vigil.integrations.megatron` calls for every Megatron-core group);
- a DeviceMesh dimension: torch names a mesh's groups `mesh_<dim>` (`mesh_tp`, a flattened
  `mesh_dp_cp`), the label is the dimension's name;
- any other `group_desc` given to `new_group` (`"tp"`), as it is;
- otherwise `pg` (an unlabelled group) and `world` for the default group.

Labels must be the same on every member rank; the SDK cannot check that without a collective,
so callers label from the same layout on every rank (a DeviceMesh, Megatron's parallel_state).
This module keeps a process-wide table and does no I/O and no torch.distributed calls beyond
reading a group's attributes.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# A label plus ":<id>" and a point-to-point suffix (":p2p:<low>-<high>") must fit the progress
# page's 32-byte group field, or heartbeats and records would name a group differently.
MAX_LABEL_LEN = 16
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MESH_PREFIX = "mesh_"
_UNNAMED_DESCS = ("", "undefined", "default_pg", "mesh_default")

_lock = threading.Lock()
_labels: dict[str, str] = {}  # group_name -> label (group names are unique within a process)


def check_label(label: Any) -> str:
    """`label` if it is a usable group label, else ValueError/TypeError saying why."""
    if not isinstance(label, str):
        raise TypeError(f"a group label is a str, not {type(label).__name__}")
    if not label:
        raise ValueError("a group label must not be empty")
    if len(label) > MAX_LABEL_LEN:
        raise ValueError(
            f"group label {label!r} is {len(label)} characters; at most {MAX_LABEL_LEN}"
        )
    if not _LABEL.fullmatch(label):
        raise ValueError(
            f"group label {label!r} may hold only letters, digits, '_', '-' and '.', "
            "starting with a letter or digit (':' separates the label from the group's id)"
        )
    if label in ("world", "pg"):
        raise ValueError(f"group label {label!r} is reserved (the default and unlabelled groups)")
    return label


def set_label(group: Any, label: str) -> bool:
    """Record `label` for `group` (a torch ProcessGroup); True when it changed the group's
    label. TypeError for anything that is not a process group, ValueError for the default
    group or a bad label."""
    label = check_label(label)
    ident = getattr(group, "group_name", None)
    if not isinstance(ident, str) or not hasattr(group, "size"):
        raise TypeError(f"label_group needs a torch.distributed ProcessGroup, not {group!r}")
    if _is_world(group):
        raise ValueError("the default process group is always labelled 'world'")
    with _lock:
        before = _labels.get(ident)
        _labels[ident] = label
    return before != label


def label_of(group: Any) -> str:
    """The label of `group` (see the module docstring for where it comes from)."""
    if group is None or _is_world(group):
        return "world"
    ident = getattr(group, "group_name", None)
    if isinstance(ident, str):
        label = _labels.get(ident)
        if label is not None:
            return label
    desc = getattr(group, "group_desc", "")
    if not isinstance(desc, str) or desc in _UNNAMED_DESCS:
        return "pg"
    if desc.startswith(_MESH_PREFIX):
        desc = desc[len(_MESH_PREFIX) :]
    desc = desc.replace(":", "_")
    return desc[:MAX_LABEL_LEN] or "pg"


def describe(group: Any) -> str:
    """The group's name on the wire: `world`, else `<label>:<group_name>` (at most 32 bytes)."""
    label = label_of(group)
    if label == "world":
        return label
    return f"{label}:{getattr(group, 'group_name', '?')}"[:32]


def clear() -> None:
    """Forget every label set by `set_label` (tests; a process that tears down its groups)."""
    with _lock:
        _labels.clear()


def _is_world(group: Any) -> bool:
    import torch.distributed as dist

    return group is dist.GroupMember.WORLD or (
        dist.is_initialized() and group is dist.distributed_c10d._get_default_group()
    )
