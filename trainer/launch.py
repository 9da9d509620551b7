"""A minimal local launcher for `vigil train --nproc N`: N ranks of `python -m vigil.trainer` on
this host with torchrun's environment variables, a fresh rendezvous port, and fail-fast
supervision (one rank failing stops the others, and its exit code is the job's).

It restarts nothing: restarts, budgets and recovery belong to vigil's supervisor (vigil.recovery),
which launches ranks the same way. This module must not import torch.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

_GLOBAL_OPTIONS = ("--log-level", "--log-format")  # options of `vigil` before the subcommand
_POLL_S = 0.2
_GRACE_S = 10.0  # how long ranks get to exit after SIGTERM before SIGKILL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_argv(argv: Sequence[str]) -> list[str]:
    """The `train` subcommand's own arguments from `vigil [...] train ARGS`, without --nproc."""
    args = list(argv)
    i = 0
    while i < len(args) and args[i].startswith("-"):  # skip `vigil`'s global options
        i += 1 if "=" in args[i] or args[i] not in _GLOBAL_OPTIONS else 2
    if i < len(args) and args[i] == "train":
        args = args[i + 1 :]
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def rank_env(
    rank: int, nproc: int, port: int, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_GRACE_S)


def launch_local(nproc: int, args: Sequence[str], *, timeout_s: float | None = None) -> int:
    """Run `nproc` ranks to completion; the first non-zero exit code wins."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    port = free_port()
    command = [sys.executable, "-m", "vigil.trainer", *args]
    procs = [subprocess.Popen(command, env=rank_env(r, nproc, port)) for r in range(nproc)]
    log.info("launched %d ranks (rendezvous port %d)", nproc, port)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            # Peers of a crashed rank fail too (exit 1, "connection closed"); when both are seen
            # in one poll, the specific code of the rank that failed first is the job's.
            failed = sorted(
                ((c, r) for r, c in enumerate(codes) if c not in (None, 0)), key=lambda f: f[0] == 1
            )
            if failed:
                code, rank = failed[0]
                log.error("rank %d exited with %d: stopping the others", rank, code)
                _stop_all(procs)
                return int(code or 1)
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                log.error("ranks still running after %.0fs: stopping them", timeout_s)
                _stop_all(procs)
                return 1
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _stop_all(procs)
        raise
