"""Stack dumps of hung ranks (py-spy `dump` or Python faulthandler text), grouped by identity.

A hang usually leaves most ranks in one stack (waiting in the collective) and the culprits in
another; grouping identical stacks turns thousands of dumps into a few lines. Each file holds
one rank's dump; its rank is the file name's trailing number (`stacks-rank-00003.txt`). Only the
main thread is compared (py-spy's "MainThread", faulthandler's "Current thread"). Pure text
parsing; no I/O beyond reading the given file.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

_RANK = re.compile(r"(\d+)\D*$")
_PYSPY_THREAD = re.compile(r'^Thread \S+ \((?:active|idle|active\+gil)\): "(?P<name>[^"]*)"')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<where>[^()]*:\d+)\)\s*$")
_FAULT_THREAD = re.compile(r"^(?P<current>Current thread|Thread) 0x[0-9a-fA-F]+")
_FAULT_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')


def parse(text: str) -> tuple[str, ...]:
    """The main thread's frames, innermost first, as "function (file:line)"."""
    threads: list[tuple[bool, list[str]]] = []
    for line in text.splitlines():
        if m := _PYSPY_THREAD.match(line):
            threads.append((m.group("name") == "MainThread", []))
        elif m := _FAULT_THREAD.match(line):
            threads.append((m.group("current") == "Current thread", []))
        elif threads and (m := _PYSPY_FRAME.match(line)):
            threads[-1][1].append(f"{m.group('func')} ({m.group('where')})")
        elif threads and (m := _FAULT_FRAME.match(line)):
            threads[-1][1].append(f"{m.group('func')} ({m.group('file')}:{m.group('line')})")
    if not threads:
        return ()
    main = next((frames for is_main, frames in threads if is_main), threads[-1][1])
    return tuple(main)


def rank_of(path: Path) -> int | None:
    match = _RANK.search(path.stem)
    return int(match.group(1)) if match else None


def group(stacks: Mapping[int, Sequence[str]]) -> list[tuple[list[int], tuple[str, ...]]]:
    """Ranks grouped by identical stack, largest group first."""
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for rank, stack in stacks.items():
        groups[tuple(stack)].append(rank)
    return sorted(((sorted(r), s) for s, r in groups.items()), key=lambda x: (-len(x[0]), x[0]))
