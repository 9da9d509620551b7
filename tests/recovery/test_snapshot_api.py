"""The public snapshot API in one process: what a restore gives back, what is skipped and
counted, which step all ranks pick, and what bad input is told."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import vigil.agent
from vigil.recovery import snapshot_restore, snapshots
from vigil.recovery.snapshot import Snapshotter


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    return model, optimizer, schedule


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: object) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    schedule.step()  # type: ignore[attr-defined]


def test_restore_brings_back_model_optimizer_schedule_and_rng(tmp_path: Path) -> None:
    model, optimizer, schedule = make()
    snaps = vigil.agent.snapshots(
        model, optimizer, extra={"schedule": schedule}, rng=True, job="j", root=tmp_path
    )
    assert snaps.enabled and snaps.restore() is None and snaps.restored_from is None
    for step in range(3):
        train(model, optimizer, schedule)
        assert snaps.save(step)
        assert snaps.flush(10)
    snaps.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    draw = torch.rand(3)  # the global RNG right after the last snapshot
    train(model, optimizer, schedule)  # a step the snapshot must not contain

    fresh, fresh_opt, fresh_schedule = make(seed=1)
    again = snapshots.Snapshots(
        fresh, fresh_opt, extra={"schedule": fresh_schedule}, rng=True, job="j", root=tmp_path
    )
    assert again.restore() == 3 and again.restored_from == "local"
    for key, value in fresh.state_dict().items():  # BatchNorm's running stats included
        assert torch.equal(value, expected[key]), key
    for param, moment in zip(fresh.parameters(), moments, strict=True):
        assert torch.equal(fresh_opt.state[param]["exp_avg"], moment)
    assert fresh_schedule.last_epoch == 3 and fresh_opt.param_groups[0]["lr"] == 0.05
    assert torch.equal(torch.rand(3), draw)
    again.close()


def test_a_newer_checkpoint_wins_and_an_older_one_does_not(tmp_path: Path) -> None:
    model, optimizer, schedule = make()
    snaps = snapshots.Snapshots(model, optimizer, job="j", root=tmp_path)
    for step in range(5):
        train(model, optimizer, schedule)
        snaps.save(step)
        snaps.flush(10)
    snaps.close()
    assert snaps.restore(checkpoint_step=4) is None  # the checkpoint holds step 4 already
    assert snaps.restore(checkpoint_step=3) == 5


def test_a_step_is_skipped_and_counted_while_the_previous_one_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, schedule = make()
    snaps = snapshots.Snapshots(model, optimizer, job="j", root=tmp_path)
    assert snaps.writer is not None
    gate = threading.Event()
    write = snaps.writer.files.write_primary

    def slow_write(step: int, state: object) -> Path:
        gate.wait(10)
        return write(step, state)  # type: ignore[arg-type]

    monkeypatch.setattr(snaps.writer.files, "write_primary", slow_write)
    train(model, optimizer, schedule)
    assert snaps.save(0)
    train(model, optimizer, schedule)  # the optimizer step waits for step 0's copies only
    assert not snaps.save(1) and not snaps.save(2)
    gate.set()
    assert snaps.flush(10)
    stats = snaps.stats
    assert (stats.num_saved, stats.num_skipped, stats.last_step) == (1, 2, 0)
    assert stats.stall_s_total > 0 and stats.bytes_last > 0
    train(model, optimizer, schedule)
    assert snaps.save(3)
    snaps.close()
    assert snaps.stats.num_saved == 2


def test_the_snapshot_holds_the_state_of_its_step_although_the_copy_is_deferred(
    tmp_path: Path,
) -> None:
    """Parameters are copied in the background; the next optimizer step waits for the copy,
    so the snapshot never holds a later step's weights."""
    model, optimizer, schedule = make()
    snaps = snapshots.Snapshots(model, optimizer, job="j", root=tmp_path)
    train(model, optimizer, schedule)
    expected = [p.detach().clone() for p in model.parameters()]
    snaps.save(0)
    for _ in range(3):
        train(model, optimizer, schedule)
    snaps.close()
    saved = torch.load(tmp_path / "j" / snaps.files.node / "rank-0" / "step-0.pt")  # type: ignore[union-attr]
    got = [saved["model"][k] for k in ("0.weight", "0.bias", "1.weight", "1.bias")]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_partial_files_are_never_restored(tmp_path: Path) -> None:
    model, optimizer, schedule = make()
    snaps = snapshots.Snapshots(model, optimizer, job="j", root=tmp_path)
    train(model, optimizer, schedule)
    snaps.save(0)
    snaps.close()
    folder = tmp_path / "j" / snaps.files.node / "rank-0"  # type: ignore[union-attr]
    (folder / ".step-9.tmp").write_bytes(b"half a snapshot")  # a write cut short
    assert snaps.restore() == 1
    train(model, optimizer, schedule)
    snaps.save(1)
    snaps.close()
    assert sorted(p.name for p in folder.iterdir()) == ["step-0.pt", "step-1.pt"]  # reused


def test_without_a_snapshot_dir_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VIGIL_SNAPSHOT_DIR", raising=False)
    model, optimizer, _ = make()
    snaps = snapshots.Snapshots(model, optimizer)
    assert not snaps.enabled and snaps.restore() is None and not snaps.save(0)
    snaps.close()


def test_bad_input_is_explained(tmp_path: Path) -> None:
    model, optimizer, _ = make()
    with pytest.raises(TypeError, match=r"extra\['loader'\] has no state_dict"):
        snapshots.Snapshots(model, optimizer, extra={"loader": object()}, root=tmp_path)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="needs its model"):
        snapshots.Snapshots(None, optimizer, root=tmp_path)
    snaps = snapshots.Snapshots(model, optimizer, root=tmp_path)
    with pytest.raises(ValueError, match="snapshot format"):
        snaps.load({"format": 99})
    with pytest.raises(ValueError, match="snapshot of a 4-rank job; this one has 1 ranks"):
        snaps.load({"format": snapshots.FORMAT, "world_size": 4})
    snaps.close()


def test_every_rank_picks_the_newest_step_all_of_them_can_get() -> None:
    # rank 0 and 1 on node A (with replicas of 2 and 3), node B's memory lost except step 6.
    held = [
        [(0, 6), (0, 7), (1, 6), (1, 7), (2, 6), (2, 7), (3, 6), (3, 7)],
        [(0, 6), (0, 7), (1, 6), (1, 7), (2, 6), (2, 7), (3, 6), (3, 7)],
        [(2, 6)],
        [],
    ]
    plans = snapshot_restore.plans(held, world_size=4, newer_than=-1)
    assert [p.step for p in plans] == [7, 6]
    assert plans[0].sources == {0: 0, 1: 1, 2: 0, 3: 0}
    assert plans[1].sources[2] == 2  # its own copy first
    assert [p.step for p in snapshot_restore.plans(held, 4, newer_than=6)] == [7]
    assert snapshot_restore.plans([[(0, 5)], [(1, 4)]], 2, -1) == []  # no common step


def test_low_level_snapshotter_keeps_the_newest_two(tmp_path: Path) -> None:
    files = Snapshotter(job="j", node="n", rank=0, world_size=1, ranks_per_node=1, root=tmp_path)
    for step in range(4):
        files.save(step, {"w": torch.full((2,), float(step))})
    newest = files.newest()
    assert newest is not None and newest.step == 3
    assert sorted(p.name for p in files.primary_dir().iterdir()) == ["step-2.pt", "step-3.pt"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_staging_is_pinned_and_the_snapshot_holds_its_step(tmp_path: Path) -> None:
    """The CUDA path (pinned buffers, copies on a side stream the next optimizer step waits
    for). Not run on this development host, which has no GPU; `pytest -m gpu` on a GPU machine."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    snaps = snapshots.Snapshots(model, optimizer, job="j", root=tmp_path)
    model(torch.randn(8, 256, device="cuda")).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    assert snaps.save(0)
    for _ in range(3):  # later steps must not leak into the snapshot of step 0
        model(torch.randn(8, 256, device="cuda")).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    snaps.close()
    assert snaps.writer is not None
    assert all(b.is_pinned() for b in snaps.writer._stager._buffers.values())
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).cuda()
    again = snapshots.Snapshots(
        fresh, torch.optim.AdamW(fresh.parameters()), job="j", root=tmp_path
    )
    assert again.restore() == 1
    for key, value in fresh.state_dict().items():
        assert torch.equal(value.cpu(), expected[key]), key
    again.close()
