"""Collects a training process's Python stacks from outside it: py-spy first, faulthandler second.

py-spy reads the stacks through ptrace without the process's cooperation, so it works even when
the process is wedged in C code holding the GIL. Where py-spy is missing or not allowed (no
CAP_SYS_PTRACE in a container), the fallback sends the signal the SDK registered with
faulthandler and reads what the process wrote to its stacks file. Every call is bounded by a
timeout. Touches only the target process (read-only) and its stacks file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Stacks:
    method: str  # "py-spy", "faulthandler" or "none"
    text: str


def py_spy_path() -> str | None:
    """py-spy from PATH, or next to this interpreter (a virtualenv's bin/)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else None


def dump_with_py_spy(pid: int, *, timeout_s: float) -> str | None:
    exe = py_spy_path()
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("py-spy dump of pid %d failed: %s", pid, exc)
        return None
    if done.returncode != 0 or not done.stdout.strip():
        log.warning("py-spy dump of pid %d failed: %s", pid, done.stderr.strip()[:300])
        return None
    return done.stdout


def dump_with_faulthandler(
    pid: int, stacks_file: Path, *, signum: int = signal.SIGUSR1, timeout_s: float
) -> str | None:
    """Signal the process and return what its faulthandler appended to `stacks_file`."""
    try:
        before = stacks_file.stat().st_size
    except FileNotFoundError:
        return None
    try:
        os.kill(pid, signum)
    except OSError as exc:
        log.warning("cannot signal pid %d for a stack dump: %s", pid, exc)
        return None
    deadline = time.monotonic() + timeout_s
    last_size = before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        size = stacks_file.stat().st_size
        if size > before and size == last_size:  # grown, and done growing
            break
        last_size = size
    with open(stacks_file, "rb") as f:
        f.seek(before)
        text = f.read().decode("utf-8", "replace")
    return text or None


def capture(
    pid: int, *, stacks_file: Path | None, timeout_s: float, prefer_py_spy: bool = True
) -> Stacks:
    """The process's stacks by the best available method."""
    if prefer_py_spy:
        text = dump_with_py_spy(pid, timeout_s=timeout_s)
        if text:
            return Stacks("py-spy", text)
    if stacks_file is not None:
        text = dump_with_faulthandler(pid, stacks_file, timeout_s=min(timeout_s, 5.0))
        if text:
            return Stacks("faulthandler", text)
    return Stacks("none", "")
