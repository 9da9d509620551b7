"""The training thread's CPU wait: time it was ready to run but waited for a CPU.

Linux counts, per thread, the nanoseconds it has spent runnable on a runqueue without running
(`/proc/<pid>/task/<tid>/schedstat`, second field; kernels built with CONFIG_SCHED_INFO, which
every mainstream distribution's are). Over one step that is time the host took from the rank
(other processes, data-loader workers, more ranks than cores): not the rank's own work. The
analyzer leaves it out of the rank's compute (`StepRecord.cpu_wait_s`). On a host with a core
per rank it is near zero, and subtracting it changes nothing.

`ThreadCpuWait` keeps the calling thread's file open and re-reads it at offset 0 (a seq_file
regenerates its text on every read): one `pread` per step boundary, a few microseconds.
"""

from __future__ import annotations

import contextlib
import os
import threading

_PATH = "/proc/thread-self/schedstat"


class ThreadCpuWait:
    """Seconds the thread that calls `read` has waited for a CPU since it started; 0.0 where
    the kernel does not say. The file is opened on the first read, in the reading thread; a
    read from another thread reopens it there."""

    __slots__ = ("_fd", "_thread", "available")

    def __init__(self) -> None:
        self._fd = -1
        self._thread = -1
        self.available = True

    def read(self) -> float:
        if not self.available:
            return 0.0
        if self._thread != threading.get_ident():
            self._open()
            if not self.available:
                return 0.0
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) * 1e-9
        except (OSError, IndexError, ValueError):
            self.available = False
            return 0.0

    def _open(self) -> None:
        self.close()
        try:
            self._fd = os.open(_PATH, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.available = False
            return
        self._thread = threading.get_ident()

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd, self._thread = -1, -1
