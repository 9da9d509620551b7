"""A rank's last word when SIGTERM stops it, said even while its training thread is blocked.

SIGTERM is how ranks are stopped from outside: torchrun stops a failed rank's survivors with it,
Kubernetes evicts, preempts and drains nodes with it, a user's `kill` sends it. By default it
ends the process on the spot, so a stopped rank falls silent just as a rank killed outright does
(the OOM killer's SIGKILL), and the analyzer could not tell torchrun's survivors from the rank
whose death made torchrun stop them (`analyzer/crashes.py`).

`install` catches SIGTERM only where nothing else does (its handler is the default one and
Python's wakeup fd is free; not in a container's PID 1, which SIGTERM does not end): a trainer's
or a framework's own handler decides how its process ends, and is left alone, also when it is
set after vigil's. Python runs signal handlers on the main thread between bytecodes, which a
training thread blocked in a collective never reaches; so Python's C-level handler also writes
the signal's number to a pipe (`signal.set_wakeup_fd`) that a thread of vigil's reads. That
thread (or the handler on the main thread, where something else took the wakeup fd over) calls
`on_signal` (the session queues its last word, `terminated`, and ships what it holds, within its
shutdown timeout; a shutdown already under way says its own), then ends the process by SIGTERM's
default action, as if nothing had caught it (exit status -15, no atexit handlers, no finally
blocks). SIGINT (Ctrl-C, which a terminal sends a launcher's whole process group) reaches that
pipe too: `on_interrupt` learns of it at once, even where the training thread is blocked in a
collective and raises only once that collective breaks. A forked child (a DataLoader worker)
gets SIGTERM's default back at once: it shares the pipe, and must neither be kept alive by the
handler nor end its parent."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

SIGNAL = signal.SIGTERM


class Guard:
    """The installed handler and its thread; `uninstall` gives SIGTERM its default back."""

    def __init__(
        self, on_signal: Callable[[int], None], on_interrupt: Callable[[], None] | None = None
    ) -> None:
        self._on_signal = on_signal
        self._on_interrupt = on_interrupt
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd's requirement
        self._closed = False
        self._claimed = threading.Lock()  # taken by whichever acts on the signal
        self._thread = threading.Thread(target=self._watch, name="vigil-sigterm", daemon=True)

    def _start(self) -> bool:
        previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an event loop's): theirs to keep
            signal.set_wakeup_fd(previous)
            self._closed = True
            _close(self._read, self._write)
            return False
        signal.signal(SIGNAL, self._handler)
        self._thread.start()
        return True

    def _handler(self, signum: int, frame: object) -> None:
        """The Python-level handler, on the main thread when it gets to run: the watching
        thread acts while the wakeup fd is still ours (the main thread may be in the middle of
        a shutdown, whose last word that thread waits for); where something took the fd over
        since (an event loop's signal handling), the main thread acts itself."""
        if self._thread.is_alive() and _wakeup_fd() == self._write:
            return
        self._act()

    def _act(self) -> None:
        """Say the last word and end the process, once (a second caller returns)."""
        if not self._claimed.acquire(blocking=False):
            return
        try:
            self._on_signal(SIGNAL)
        except Exception:  # the process ends below whatever happened
            log.debug("vigil SDK: last word at SIGTERM failed", exc_info=True)
        die(SIGNAL)

    def _watch(self) -> None:
        while True:
            try:
                got = os.read(self._read, 64)
            except OSError:
                got = b""
            if self._closed or not got:  # uninstalled: this thread closes its end
                _close(self._read)
                return
            # SIGINT (Ctrl-C) where Python's own handler raises KeyboardInterrupt: noted at once,
            # also while the training thread is blocked in a collective (it raises only once the
            # collective returns, often broken by peers the interrupt ended first).
            interrupt = self._on_interrupt
            if signal.SIGINT in got and interrupt is not None and _default_sigint():
                interrupt()
            # Not SIGTERM once a handler set after ours took it over (a trainer's, installed
            # after init): theirs acts.
            if SIGNAL in got and signal.getsignal(SIGNAL) == self._handler:
                self._act()

    def uninstall(self) -> None:
        """Give SIGTERM its default action back (from the main thread only: elsewhere the
        handler stays until the process ends, harmless)."""
        if self._closed or threading.current_thread() is not threading.main_thread():
            return
        global _current
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(SIGNAL) == self._handler:
                signal.signal(SIGNAL, signal.SIG_DFL)
            previous = signal.set_wakeup_fd(-1)
            if previous != self._write:  # someone else's since: theirs to keep
                signal.set_wakeup_fd(previous)
        if _current is self:
            _current = None
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")  # wakes the thread, which closes the read end
        _close(self._write)


def _default_sigint() -> bool:
    """Whether SIGINT raises KeyboardInterrupt (Python's own handler), not a trainer's."""
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _wakeup_fd() -> int:
    """The wakeup fd now set (main thread only: reading it means setting it back)."""
    fd = signal.set_wakeup_fd(-1)
    if fd != -1:
        signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    return fd


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def install(
    on_signal: Callable[[int], None], on_interrupt: Callable[[], None] | None = None
) -> Guard | None:
    """Catch SIGTERM for `on_signal` (see the module docstring), and tell `on_interrupt` when
    SIGINT comes (Python's own handler raises KeyboardInterrupt for it); None where it is not
    this process's to catch: not the main thread, a handler already set, the wakeup fd in use,
    or the process is its PID namespace's init (PID 1 in a container), which SIGTERM does not
    end by default: caught, it would."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(SIGNAL) is not signal.SIG_DFL:
        return None
    if os.getpid() == 1:  # a container's init: the kernel ignores SIGTERM's default for it
        return None
    global _current
    guard = Guard(on_signal, on_interrupt)
    if not guard._start():
        return None
    _after_fork_once()
    _current = guard
    return guard


_current: Guard | None = None  # the installed guard
_fork_hook_registered = False


def _after_fork_once() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_reset_in_child)
        _fork_hook_registered = True


def _reset_in_child() -> None:
    """A forked child does not inherit the watching thread: SIGTERM ends it by default again,
    and its signals no longer reach the parent's pipe."""
    global _current
    guard, _current = _current, None
    if guard is None:
        return
    guard._closed = True
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(SIGNAL) == guard._handler:
            signal.signal(SIGNAL, signal.SIG_DFL)
        previous = signal.set_wakeup_fd(-1)
        if previous not in (-1, guard._write):  # someone else's since: theirs to keep
            signal.set_wakeup_fd(previous)
    _close(guard._read, guard._write)  # this process's copies: the parent keeps its own


def die(signum: int) -> None:
    """End the process by `signum`'s default action, from any thread: the C library's
    `signal` resets the disposition (Python's `signal.signal` works on the main thread only),
    then the signal is raised again; 128 + signum is the exit status if that fails."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signum), None)  # SIG_DFL is 0
        os.kill(os.getpid(), signum)
        threading.Event().wait(5.0)  # delivery is asynchronous
    finally:
        os._exit(128 + int(signum))
