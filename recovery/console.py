"""`vigil run`'s console: the running attempt's rank output, each line prefixed `[rank N] `.

The ranks write to their log files (`<run dir>/attempts/attempt-<n>/rank-<r>.log`, kept for
later); `RankEcho` follows the current attempt's files from a thread and copies each complete
line to a stream. When the controller starts a new attempt, what is left of the old one is
printed first, then the new attempt's files are followed from their start. Reads files, writes
one stream; touches no process.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

_RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
# A line longer than this is printed in pieces (a progress bar without newlines stays visible).
MAX_LINE = 64 * 1024


@dataclass(kw_only=True)
class RankEcho:
    # The folder holding the current attempt's rank logs (it changes when a restart happens).
    current_dir: Callable[[], Path | None]
    out: TextIO
    interval_s: float = 0.1
    _offsets: dict[Path, int] = field(default_factory=dict, init=False)
    _partial: dict[Path, bytes] = field(default_factory=dict, init=False)
    _folder: Path | None = field(default=None, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vigil-rank-echo", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Print what the ranks wrote last, then stop following."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.poll(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self, *, final: bool = False) -> None:
        folder = self.current_dir()
        if folder != self._folder:
            if self._folder is not None:
                self._drain(self._folder, final=True)
            self._folder = folder
            self._offsets.clear()
            self._partial.clear()
        if folder is not None:
            self._drain(folder, final=final)

    def _drain(self, folder: Path, *, final: bool) -> None:
        if not folder.is_dir():
            return
        logs = []
        for path in folder.iterdir():
            match = _RANK_LOG.match(path.name)
            if match:
                logs.append((int(match.group(1)), path))
        for rank, path in sorted(logs):
            try:
                with path.open("rb") as fh:
                    fh.seek(self._offsets.get(path, 0))
                    data = fh.read()
            except OSError:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            data = self._partial.pop(path, b"") + data
            lines = data.split(b"\n")
            rest = lines.pop()
            if (final and rest) or len(rest) > MAX_LINE:
                lines.append(rest)
            elif rest:
                self._partial[path] = rest
            for line in lines:
                text = line.decode(errors="replace").rstrip("\r")
                self.out.write(f"[rank {rank}] {text}\n")
        self.out.flush()
