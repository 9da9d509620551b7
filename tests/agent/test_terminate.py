"""The rank's last word at SIGTERM: said while the training thread is blocked in a collective,
then the process ends as SIGTERM ends it; a trainer's own handler, a forked DataLoader-style
child and Ctrl-C keep their behaviour."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.realjobs import launch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# A 2-rank gloo job, vigil added as the README says; `BEFORE` runs before init, `AFTER` where
# the rank waits to be stopped (rank 1 never joins rank 0's last all-reduce).
JOB = """
import os, sys, time, signal, datetime, torch, torch.distributed as dist
import vigil.agent
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
{before}
vigil.agent.init(job="t", output_dir=sys.argv[1], last_word_on_sigterm={enabled}{extra})
for step in range(3):
    with vigil.agent.step(step):
        dist.all_reduce(torch.ones(4))
print("ready", flush=True)
{after}
"""
BLOCKED = """
if rank == 1:
    time.sleep(100)
dist.all_reduce(torch.ones(4))  # rank 0 waits here, inside gloo
"""


def _start(
    tmp_path: Path,
    *,
    before: str = "",
    after: str = BLOCKED,
    enabled: bool = True,
    extra: str = "",
) -> list[subprocess.Popen[str]]:
    code = JOB.format(before=before, after=after, enabled=enabled, extra=extra)
    port = launch.free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")},
            "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    return procs


def _states(tmp_path: Path, rank: int) -> list[str]:
    lines = (tmp_path / "t" / f"rank-{rank:05d}.jsonl").read_text().splitlines()
    return [r["state"] for r in map(json.loads, lines) if r.get("type") == "heartbeat"]


def _stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_a_rank_blocked_in_a_collective_says_terminated_and_ends_by_sigterm(
    tmp_path: Path,
) -> None:
    procs = _start(tmp_path)
    try:
        time.sleep(1.0)  # rank 0 is inside the all-reduce rank 1 never joins
        began = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(20) == -signal.SIGTERM  # as if nothing had caught it
        assert time.monotonic() - began < 10
    finally:
        _stop_all(procs)
    assert _states(tmp_path, 0)[-1] == "terminated"


# The trainer's own handler (a checkpoint-and-exit): set before vigil's init, or after it. Like
# a real one it ends its process group before it exits: a rank that exits with its gloo group
# alive can abort as the interpreter finalizes (gloo's worker threads release the tensors of
# finished work after the interpreter is gone: SIGABRT, seen twice under CI's load, not in ~190
# runs outside it).
MINE = """
def mine(signum, frame):
    print("the trainer's handler", flush=True)
    dist.destroy_process_group()
    sys.exit(75)
signal.signal(signal.SIGTERM, mine)
"""
WAIT = "print('waiting', flush=True)\ntime.sleep(60)"


@pytest.mark.parametrize("when", ["before init", "after init"])
def test_a_trainers_own_sigterm_handler_is_left_alone(tmp_path: Path, when: str) -> None:
    if when == "before init":
        procs = _start(tmp_path, before=MINE, after=WAIT)
    else:
        procs = _start(tmp_path, after=MINE + WAIT)
    try:
        assert procs[0].stdout is not None and procs[0].stdout.readline().strip() == "waiting"
        procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait(20)
        assert code == 75, (code, procs[0].stderr.read() if procs[0].stderr else "")
        assert "the trainer's handler" in procs[0].stdout.read()
    finally:
        _stop_all(procs)
    assert "terminated" not in _states(tmp_path, 0)


def test_turned_off_sigterm_ends_the_rank_at_once_without_a_word(tmp_path: Path) -> None:
    procs = _start(tmp_path, enabled=False)
    try:
        time.sleep(1.0)
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(20) == -signal.SIGTERM
    finally:
        _stop_all(procs)
    assert "terminated" not in _states(tmp_path, 0)


def test_a_forked_child_ends_by_sigterm_and_its_parent_trains_on(tmp_path: Path) -> None:
    # A DataLoader worker's shape: forked after init, stopped with SIGTERM by its parent.
    after = """
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
with vigil.agent.step(3):
    dist.all_reduce(torch.ones(4))
vigil.agent.shutdown()
print("parent", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""
    procs = _start(tmp_path, after=after)
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        _stop_all(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert f"child {-signal.SIGTERM}" in outs[0][0], outs[0]
    assert "parent True" in outs[0][0], outs[0]  # shutdown gave SIGTERM its default back
    assert _states(tmp_path, 0)[-1] == "finished"


def test_ctrl_c_still_interrupts_the_training_loop(tmp_path: Path) -> None:
    after = """
try:
    print("waiting", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    vigil.agent.shutdown()
"""
    procs = _start(tmp_path, after=after)
    try:
        assert procs[0].stdout is not None and procs[0].stdout.readline().strip() == "waiting"
        procs[0].send_signal(signal.SIGINT)
        out, _ = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 0 and "interrupted" in out
    finally:
        _stop_all(procs)
    assert _states(tmp_path, 0)[-1] == "terminated"  # stopped from outside, not failed


def test_ctrl_c_on_a_rank_blocked_in_a_collective_that_then_breaks_says_terminated(
    tmp_path: Path,
) -> None:
    """Ctrl-C reaches every rank of a launcher at once; a rank blocked in a collective raises
    only when that collective returns, broken by the peers the interrupt ended (a gloo
    connection error, not a KeyboardInterrupt). Its last word is still `terminated`: a job
    stopped with Ctrl-C read as a crash naming the first rank to fail (a real 4-rank job under
    torchrun, every rank `failed`)."""
    procs = _start(tmp_path)
    try:
        time.sleep(1.0)  # rank 0 is inside the all-reduce rank 1 never joins
        procs[0].send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert procs[0].poll() is None  # still blocked: Python has not raised yet
        procs[1].kill()  # the peer the interrupt ended
        procs[0].wait(30)
    finally:
        _stop_all(procs)
    assert _states(tmp_path, 0)[-1] == "terminated"


class _SlowCollector(http.server.BaseHTTPRequestHandler):
    """Answers every batch after a second, with 503: the rank's shipments take that long."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(1.0)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_sigterm_while_an_exception_ends_the_rank_keeps_its_last_word_failed(
    tmp_path: Path,
) -> None:
    """A torchrun survivor: its collective broke (an exception ends it) and torchrun's SIGTERM
    comes as Python prints the traceback, while the last word is still on its way to a slow
    collector. The word is `failed` (the exception ended the rank; the signal only came
    after); the interpreter does not finish exiting under the signal's thread (which left the
    rank without a word, 1 torchrun run in ~14); and the process still ends by SIGTERM."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowCollector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    extra = f", collector={url!r}, also_jsonl=True, shutdown_timeout_s=4.0"
    after = """
def hook(kind, value, tb):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's, as the traceback is printed
    time.sleep(0.3)
    sys.__excepthook__(kind, value, tb)
sys.excepthook = hook
if rank == 0:
    raise RuntimeError("Connection closed by peer")
time.sleep(30)
"""
    try:
        procs = _start(tmp_path, after=after, extra=extra)
        try:
            assert procs[0].wait(30) == -signal.SIGTERM
        finally:
            _stop_all(procs)
    finally:
        server.shutdown()
        server.server_close()
    assert _states(tmp_path, 0)[-1] == "failed"


def test_sigterm_while_the_last_word_is_written_waits_for_it(tmp_path: Path) -> None:
    """torchrun's SIGTERM reaching a rank whose exit is writing its last word (its collective
    broke, or it finished) while the flusher is still busy (a POST to a busy collector): the
    word is written, then the process ends by SIGTERM. Before, SIGTERM's default came back at
    the start of that shutdown and ended the rank without a word (CI: two of torchrun's
    survivors)."""
    after = """
session = vigil.agent.current()
stop = session.flusher.stop
def slow_stop(**kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's, while the flusher is still stopping
    time.sleep(0.5)
    stop(**kwargs)
session.flusher.stop = slow_stop
vigil.agent.shutdown()
print("after shutdown", flush=True)
time.sleep(30)
"""
    procs = _start(tmp_path, after=after)
    try:
        assert procs[0].wait(30) == -signal.SIGTERM
    finally:
        _stop_all(procs)
    assert _states(tmp_path, 0)[-1] == "finished"  # the shutdown under way says its own
