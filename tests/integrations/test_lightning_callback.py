"""`VigilCallback` in one process: a real single-device Lightning Trainer in the test process.

What the multi-rank tests (test_lightning.py) do not show: bad options refused, a session the
user started being used and left running, a checkpoint request on one rank, token counting
rules, N for MFU, and that a broken or disabled SDK never stops training.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import vigil.agent
from tests.integrations import lightning_job as job
from vigil import schema
from vigil.integrations.lightning import VigilCallback, count_tokens, model_params

pytestmark = pytest.mark.timeout(120)


def _fit(tmp_path: Path, callbacks: list[pl.Callback], *, steps: int = 4) -> job.TinyGPT:
    pl.seed_everything(0, verbose=False)
    module = job.TinyGPT(slow_rank=-1, slow_s=0.0, slow_from=0)
    loader = DataLoader(job.PaddedTokens(steps * 2 * job.BATCH, 0), batch_size=job.BATCH)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        **job.trainer_options(steps=steps, accumulate=2, root=tmp_path),
    )
    trainer.fit(module, loader)
    assert trainer.global_step == steps
    return module


def _records(folder: Path, kind: str) -> list[dict[str, Any]]:
    lines = (folder / "rank-00000.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def _options(tmp_path: Path) -> dict[str, Any]:
    return {
        "collector": None,
        "output_dir": tmp_path / "out",
        "progress_dir": tmp_path / "pages",
        "peak_flops": 1e11,
    }


class _RequestAt(pl.Callback):
    """Asks the running session for a checkpoint as the step of `global_step` starts."""

    def __init__(self, global_step: int) -> None:
        self.global_step = global_step

    def on_train_batch_start(self, trainer: pl.Trainer, *_args: Any) -> None:
        session = vigil.agent.current()
        if trainer.global_step == self.global_step and session is not None:
            session.request_control("checkpoint")
            self.global_step = -1


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"peak_flops": 0}, ValueError, "peak_flops must be > 0"),
        ({"job": ""}, ValueError, "job must be a non-empty name"),
        ({"tokens_fn": 3}, TypeError, "tokens_fn must be callable"),
        ({"model_shape": {"layers": 2}}, TypeError, "model_shape must be a vigil.schema"),
        ({"rank": 1}, TypeError, "'rank' is not an option"),
    ],
)
def test_bad_options_are_refused_naming_the_option(
    options: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        VigilCallback(**options)


def test_tokens_are_counted_from_the_mask_else_the_ids() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ids = torch.ones(2, 3, dtype=torch.long)
    assert count_tokens({"input_ids": ids, "attention_mask": mask}) == 3
    assert count_tokens({"input_ids": ids}) == 6
    assert count_tokens((ids, torch.zeros(2))) == 6  # (ids, labels)
    assert count_tokens(torch.zeros(2, 3)) == 0  # floats are not token ids
    assert count_tokens({"pixels": torch.zeros(2)}) == 0


def test_mfu_params_leave_out_embedding_tables_but_count_a_tied_head() -> None:
    untied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    assert model_params(untied) == 40
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert model_params(tied) == 40  # one table, used as the head's matmul


def test_a_users_own_session_is_used_and_a_request_saves_a_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    session = vigil.agent.init(job="own", **_options(tmp_path))
    assert session is not None
    callback = VigilCallback(job="other", tokens_fn=lambda batch: 7)
    try:
        with caplog.at_level(logging.WARNING, logger="vigil.integrations.lightning"):
            _fit(tmp_path, [_RequestAt(1), callback])
        assert vigil.agent.current() is session  # the user's to shut down
    finally:
        vigil.agent.shutdown()
    assert "a session runs already; VigilCallback uses it and ignores job" in caplog.text
    steps = _records(tmp_path / "out" / "own", "step")
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert [r["tokens"] for r in steps] == [14] * 4  # tokens_fn, two micro-batches a step
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in steps)
    assert all(r["data_s"] > 0 for r in steps[1:])  # the loader's time between batches
    # Requested during step 1: saved at its end, when global_step is 2.
    saved = tmp_path / "checkpoints" / "vigil-step=2.ckpt"
    assert callback.checkpoints == [saved]
    assert torch.load(saved, weights_only=False)["global_step"] == 2
    assert callback.errors == 0


def test_a_failing_or_disabled_sdk_never_stops_training(tmp_path: Path) -> None:
    def broken_tokens(batch: Any) -> int:
        raise RuntimeError("tokens_fn bug")

    reference = _fit(tmp_path / "plain", [])
    # The SDK refuses the job name: no session, training as without vigil.
    refused = VigilCallback(job="no/slashes", **_options(tmp_path))
    trained = _fit(tmp_path / "refused", [refused])
    assert vigil.agent.current() is None
    for a, b in zip(trained.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    # A hook that fails is counted and logged; the steps are still recorded.
    failing = VigilCallback(job="failing", tokens_fn=broken_tokens, **_options(tmp_path))
    _fit(tmp_path / "failing", [failing])
    assert failing.errors == 8 and vigil.agent.current() is None
    steps = _records(tmp_path / "out" / "failing", "step")
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    # enabled=False: nothing started, nothing written.
    off = VigilCallback(job="off", enabled=False, **_options(tmp_path))
    _fit(tmp_path / "off", [off])
    assert not (tmp_path / "out" / "off").exists()


def test_mfu_comes_from_the_shape_passed(tmp_path: Path) -> None:
    shape = schema.ModelShape(params=0, layers=job.LAYERS, hidden=job.HIDDEN, seq_len=job.SEQ)
    callback = VigilCallback(job="shape", model_shape=shape, **_options(tmp_path))
    module = _fit(tmp_path, [callback], steps=2)
    n = model_params(module)
    per_token = 6 * n + 12 * job.LAYERS * job.HIDDEN * job.SEQ
    for record in _records(tmp_path / "out" / "shape", "step"):
        assert record["model_flops"] == pytest.approx(per_token * record["tokens"])
        assert record["mfu"] > 0


class _FailsAt(job.TinyGPT):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            raise RuntimeError("a bug in training_step")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_raises_ends_the_rank_failed(tmp_path: Path) -> None:
    """The exception reaches the user unchanged; the rank's last word says failed, so its
    peers' analysis tells a crash from a clean end."""
    callback = VigilCallback(job="raises", **_options(tmp_path))
    module = _FailsAt(slow_rank=-1, slow_s=0.0, slow_from=0)
    loader = DataLoader(job.PaddedTokens(64, 0), batch_size=job.BATCH)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        callbacks=[callback],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="a bug in training_step"):
        trainer.fit(module, loader)
    assert vigil.agent.current() is None and callback.errors == 0
    folder = tmp_path / "out" / "raises"
    assert [r["step"] for r in _records(folder, "step")] == [0, 1, 2]  # 2: the one it died in
    assert _records(folder, "heartbeat")[-1]["state"] == "failed"
