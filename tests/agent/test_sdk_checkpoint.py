"""`vigil.agent.checkpoint_committed`: a committed checkpoint reported through the SDK ships as a
`Checkpoint` record (what the recovery controller's "checkpoint now" waits for), and is a
fail-open no-op before `init` or with bad values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import vigil.agent
from vigil import codec, schema


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    session = vigil.agent.init(
        job="ckpt",
        output_dir=tmp_path / "out",
        progress_dir=tmp_path / "pages",
        rank=0,
        world_size=1,
        measure_cpu_peak=False,
        flush_interval_s=0.05,
    )
    assert session is not None
    yield tmp_path / "out"
    vigil.agent.shutdown()


def _records(out: Path) -> list[schema.Record]:
    path = out / "ckpt" / "rank-00000.jsonl"
    return [codec.decode_json(line) for line in path.read_bytes().splitlines()]


def test_a_commit_ships_as_a_checkpoint_record(out: Path) -> None:
    with vigil.agent.step(0, tokens=1):
        pass
    vigil.agent.checkpoint_committed(
        7, location="/ckpt/step-00000007", num_bytes=1024, save_s=0.5, blocked_s=0.1
    )
    vigil.agent.shutdown()
    (record,) = [r for r in _records(out) if isinstance(r, schema.Checkpoint)]
    assert (record.job_id, record.step, record.location) == ("ckpt", 7, "/ckpt/step-00000007")
    assert (record.bytes, record.save_s, record.blocked_s) == (1024, 0.5, 0.1)
    assert record.committed_s > 0


def test_bad_values_are_counted_not_raised(out: Path) -> None:
    vigil.agent.checkpoint_committed(-1, location="")  # a negative step, an empty location
    session = vigil.agent.current()
    assert session is not None and session.internal_errors == 1
    vigil.agent.shutdown()
    assert not [r for r in _records(out) if isinstance(r, schema.Checkpoint)]


def test_before_init_it_does_nothing(tmp_path: Path) -> None:
    vigil.agent.shutdown()
    vigil.agent.checkpoint_committed(1, location="/nowhere")  # no session: nothing, no error
    assert vigil.agent.current() is None
