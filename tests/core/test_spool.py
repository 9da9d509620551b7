"""The spool: constant-time pushes with a byte bound, its on-disk order, quarantine, and who may
open or claim it (the owner's flock and pid). Real files; dead owners are real exited processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vigil import codec, schema, spool

FRAME = b"x" * 100


def test_pushes_stay_constant_time_and_the_bound_drops_the_oldest(tmp_path: Path) -> None:
    # Listing and sorting the folder on each push took 43 ms at 4,000 files: 20,000 pushes did
    # not finish in 400 s. With an in-memory index these take a few seconds (the old way:
    # minutes, past the test's timeout).
    num = 10_000
    s = spool.Spool(tmp_path / "s", max_bytes=5_000 * len(FRAME))
    start = time.monotonic()
    for i in range(num):
        s.push(f"b{i}", 1, FRAME)
    took = time.monotonic() - start
    assert took < 60, f"{num} pushes took {took:.0f} s"
    assert len(s) == 5_000 and s.size_bytes() == 5_000 * len(FRAME)
    assert s.dropped_batches == num - 5_000 and s.dropped_records == num - 5_000
    assert [b.batch_id for b in s.pending()[:2]] == ["b5000", "b5001"]
    s.close()
    # The index matches the folder: a reopened spool sees the same batches in the same order.
    again = spool.Spool(tmp_path / "s", max_bytes=5_000 * len(FRAME))
    assert [b.batch_id for b in again.pending()] == [f"b{i}" for i in range(5_000, num)]
    assert again.size_bytes() == 5_000 * len(FRAME)
    again.close()


def test_reserved_places_keep_send_order(tmp_path: Path) -> None:
    s = spool.Spool(tmp_path / "s", max_bytes=10_000)
    first = s.reserve(2)  # a round still sending two batches
    s.push("later", 1, FRAME)  # another thread spools a newer one meanwhile
    s.push("a", 1, FRAME, seq=first)
    s.push("b", 1, FRAME, seq=first + 1)
    assert [b.batch_id for b in s.pending()] == ["a", "b", "later"]
    s.close()
    again = spool.Spool(tmp_path / "s", max_bytes=10_000)
    assert [b.batch_id for b in again.pending()] == ["a", "b", "later"]
    again.close()


def test_quarantine_keeps_the_newest_few(tmp_path: Path) -> None:
    s = spool.Spool(tmp_path / "s", max_bytes=10_000, max_quarantined=2)
    for i in range(3):
        s.push(f"q{i}", 1, FRAME)
    for batch in s.pending():
        s.quarantine(batch)
    s.quarantine_frame("fresh", 1, FRAME)
    kept = sorted(p.name for p in (tmp_path / "s" / spool.QUARANTINE_DIR).iterdir())
    assert [name.rsplit("-", 1)[-1] for name in kept] == ["q2.vgl", "fresh.vgl"]
    assert s.quarantined_batches == 4 and len(s) == 0 and s.size_bytes() == 0
    s.close()


def test_one_owner_at_a_time_and_a_busy_spool_gets_a_sibling(tmp_path: Path) -> None:
    first = spool.Spool(tmp_path / "rank-00000.spool", max_bytes=1000)
    with pytest.raises(spool.SpoolBusyError):
        spool.Spool(tmp_path / "rank-00000.spool", max_bytes=1000)
    second = spool.open_spool(tmp_path / "rank-00000.spool", max_bytes=1000)
    assert second.directory.name == f"rank-00000.{os.getpid()}-1.spool"
    owner = (tmp_path / "rank-00000.spool" / spool.OWNER_FILE).read_text().split()
    assert int(owner[0]) == os.getpid()
    first.close()
    second.close()


def test_a_live_owner_is_never_claimed(tmp_path: Path) -> None:
    held = spool.Spool(tmp_path / "j" / "rank-00000.spool", max_bytes=1000)
    held.push("b", 1, FRAME)
    assert spool.Spool.claim(held.directory, max_bytes=1000) is None  # its lock is held
    held.close()  # lock released, but the owner (this process) still runs
    assert spool.Spool.claim(held.directory, max_bytes=1000) is None


def _spool_in_a_process_that_exits(directory: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from vigil import spool\n"
        "s = spool.Spool(Path(sys.argv[1]), max_bytes=10_000)\n"
        "s.push('b0', 3, b'frame-0'); s.push('b1', 4, b'frame-1')\n"
        "import os; os._exit(0)\n"  # no close: the kernel releases the lock
    )
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, timeout=60)


def test_the_spool_of_an_exited_owner_is_claimed_once(tmp_path: Path) -> None:
    directory = tmp_path / "job" / "rank-00003.spool"
    _spool_in_a_process_that_exits(directory)
    assert spool.siblings(directory) == [directory]
    claimed = spool.Spool.claim(directory, max_bytes=10_000)
    assert claimed is not None and claimed.previous_owner is not None
    assert claimed.previous_owner.pid != os.getpid()
    assert [(b.batch_id, b.num_records) for b in claimed.pending()] == [("b0", 3), ("b1", 4)]
    assert spool.Spool.claim(directory, max_bytes=10_000) is None  # a second agent backs off
    for batch in claimed.pending():
        claimed.remove(batch)
    assert claimed.close_and_remove_if_empty()
    assert not directory.exists()


def test_a_reused_pid_is_not_the_owner(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "stat").write_text("4242 (python3 x) S " + " ".join(["0"] * 18) + " 777 0\n")
    assert spool.process_start(4242, proc) == "777"
    me = os.getpid()
    assert spool.owner_alive(spool.Owner(me, ""), proc)  # start unknown: the pid decides
    assert spool.owner_alive(spool.Owner(me, spool.process_start(me)))
    assert not spool.owner_alive(spool.Owner(me, "1"))  # same pid, another process


def test_any_batch_id_survives_a_reopen(tmp_path: Path) -> None:
    # A controller's ids hold '/' and may be 256 characters: no file could be named after them.
    odd = ["action-crash-a0-r1/0-restart-pending", "x" * 256]
    s = spool.Spool(tmp_path / "s", max_bytes=1 << 20)
    for batch_id in odd:
        beat = schema.Heartbeat(job_id="j", rank=0, time_s=1.0)
        s.push(batch_id, 1, codec.encode_batch([beat], batch_id=batch_id))
    s.push("plain-id", 1, FRAME)
    s.close()
    again = spool.Spool(tmp_path / "s", max_bytes=1 << 20)
    assert [b.batch_id for b in again.pending()] == [*odd, "plain-id"]
    assert all(len(b.path.name) < 100 for b in again.pending())
    again.close()


def test_a_frame_file_named_otherwise_is_taken_in_after_the_others(tmp_path: Path) -> None:
    directory = tmp_path / "s"
    directory.mkdir()
    beat = schema.Heartbeat(job_id="j", rank=0, time_s=1.0)
    (directory / "abc123.vgl").write_bytes(codec.encode_batch([beat, beat], batch_id="abc123"))
    (directory / "junk.vgl").write_bytes(b"not a frame")
    s = spool.Spool(directory, max_bytes=1 << 20)
    assert [(b.batch_id, b.num_records) for b in s.pending()] == [("abc123", 2)]
    s.push("next", 1, FRAME)
    assert [b.batch_id for b in s.pending()] == ["abc123", "next"]
    assert (directory / "junk.vgl").exists()  # left for a person, never sent
    s.close()


def test_siblings_are_the_folders_a_busy_spool_falls_back_to(tmp_path: Path) -> None:
    main = spool.Spool(tmp_path / "diag", max_bytes=1000)
    fallback = spool.open_spool(tmp_path / "diag", max_bytes=1000)
    (tmp_path / "diagnostics").mkdir()  # another sender's folder is not one of them
    assert spool.siblings(tmp_path / "diag") == [tmp_path / "diag", fallback.directory]
    main.close()
    fallback.close()
