"""Each job's declared world size, as ingest checks ranks against it (`validate.check_world`).

A batch's ranks must lie below their job's world size (from its Job record, else the largest
`RankInfo.world_size`), so storage and analysis stay proportional to ranks that exist; jobs not
declared yet are held to the collector's `max_world_size`. Sizes are read from the store once per
job and kept (bounded, least recently used first out); batches that declare a size update them.
Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

# 65,536 jobs of a few dozen bytes each: far more jobs than one collector sees at once.
_CAPACITY = 65_536


class WorldSizes:
    """`lookup(jobs)`: known world sizes (0: not declared yet) of `jobs`."""

    def __init__(
        self, load: Callable[[list[str]], Mapping[str, int]], capacity: int = _CAPACITY
    ) -> None:
        self._load = load
        self._capacity = capacity
        self._known: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, jobs: Iterable[str], declared: Mapping[str, int]) -> dict[str, int]:
        """World sizes of `jobs` and the jobs in `declared` (a batch's own declarations, which
        win over stored ones); jobs never declared are left out."""
        wanted = set(jobs) | set(declared)
        with self._lock:
            missing = sorted(j for j in wanted if j not in self._known and j not in declared)
        loaded = dict(self._load(missing)) if missing else {}
        with self._lock:
            for job, size in declared.items():
                self._remember(job, size)
            for job in missing:
                self._remember(job, loaded.get(job, 0))
            return {job: self._known[job] for job in wanted if self._known.get(job)}

    def _remember(self, job: str, size: int) -> None:
        self._known[job] = size
        self._known.move_to_end(job)
        while len(self._known) > self._capacity:
            self._known.popitem(last=False)
