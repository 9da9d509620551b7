"""`VigilCallback` in one process: the real Trainer on a tiny random GPT-2 (hf_job.py's model and
data), no process group. What a user of one machine sees: report_to="vigil", a checkpoint
request answered by Trainer's own checkpoint, MFU's model shape from the config, Trainer's own
loss for models with and without loss keywords, and training
that goes on whatever vigil's state (no session possible, a collector that is not there, a
session of the user's own, an SDK that fails in every step)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import vigil.agent
from tests.integrations import hf_job
from vigil import flops
from vigil.agent import progress
from vigil.env import EnvVar
from vigil.integrations import hf, hf_shape, save_agreement
from vigil.recovery.local import free_port

pytestmark = pytest.mark.timeout(180)


def _args(tmp_path: Path, steps: int, **more: Any) -> transformers.TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "trainer"),
        "max_steps": steps,
        "per_device_train_batch_size": hf_job.BATCH,
        "gradient_accumulation_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
        "logging_steps": 1,
        **more,
    }
    return transformers.TrainingArguments(**options)


def _trainer(
    tmp_path: Path, steps: int, callbacks: list[Any], **more: Any
) -> hf_job.CountingTrainer:
    args = _args(tmp_path, steps, **more)
    return hf_job.CountingTrainer(
        model=hf_job.model(layers=2, hidden=64),
        args=args,
        train_dataset=hf_job.Samples(steps * 2 * hf_job.BATCH + hf_job.BATCH),
        data_collator=hf_job.collate,
        callbacks=callbacks,
    )


def _steps(folder: Path) -> list[dict[str, Any]]:
    lines = (folder / "rank-00000.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "step"]


@pytest.fixture(autouse=True)
def _no_session_left() -> Any:
    yield
    vigil.agent.shutdown()  # a failed test must not leave the next one a session


class Requests(transformers.TrainerCallback):
    """The operator: asks for a checkpoint through the rank's page after step `after`."""

    def __init__(self, pages: Path, job: str, after: int) -> None:
        self.pages, self.job, self.after = pages, job, after

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.after:
            reader = progress.PageReader(progress.page_path(self.pages, self.job, 0))
            reader.request_control("checkpoint")
            reader.close()


def test_report_to_vigil_records_each_step_and_a_request_saves_the_step_it_is_seen_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf.enable()
    hf.enable()  # idempotent
    pages = tmp_path / "pages"
    monkeypatch.setenv(EnvVar.OUTPUT_DIR, str(tmp_path / "out"))
    monkeypatch.setenv(EnvVar.PROGRESS_DIR, str(pages))
    trainer = _trainer(
        tmp_path,
        6,
        [Requests(pages, "hf-one", after=2)],
        report_to=["vigil"],
        run_name="hf-one",
    )
    callbacks = trainer.callback_handler.callbacks
    assert len([c for c in callbacks if isinstance(c, hf.VigilCallback)]) == 1
    trainer.train()
    # Seen at step 3's boundary; alone, the rank saves at that step end.
    assert sorted(p.name for p in (tmp_path / "trainer").glob("checkpoint-*")) == ["checkpoint-3"]
    steps = _steps(tmp_path / "out" / "hf-one")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert [r["loss"] for r in steps] == pytest.approx(logged, abs=1e-3)  # Trainer logs 4 digits
    assert all(r["tokens"] > 0 and r["mfu"] > 0 for r in steps)
    # Reported to vigil, the record the controller's "checkpoint now" waits for.
    lines = (tmp_path / "out" / "hf-one" / "rank-00000.jsonl").read_text().splitlines()
    saved = [r for r in map(json.loads, lines) if r["type"] == "checkpoint"]
    assert [(r["step"], Path(r["location"]).name) for r in saved] == [(3, "checkpoint-3")]
    assert saved[0]["bytes"] > 0
    assert vigil.agent.current() is None  # the callback started the session and ended it


def test_the_model_shape_for_mfu_comes_from_the_config() -> None:
    gpt2 = hf_job.model(layers=2, hidden=64)  # tied head, learned positions
    shape = hf_shape.model_shape(gpt2, 48)
    assert shape is not None
    everything = sum(p.numel() for p in gpt2.parameters())
    positions = gpt2.transformer.wpe.weight.numel()
    assert shape.params == everything - positions  # the tied table counts once, as the head
    assert (shape.layers, shape.hidden, shape.heads, shape.seq_len) == (2, 64, 4, 48)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    shape = hf_shape.model_shape(llama, 16)
    assert shape is not None
    table = llama.get_input_embeddings().weight.numel()
    assert shape.params == sum(p.numel() for p in llama.parameters()) - table
    assert (shape.layers, shape.hidden, shape.heads) == (3, 32, 4)
    assert flops.flops_per_token(shape) == 6 * shape.params + 12 * 3 * 32 * 16


def test_training_runs_when_vigil_cannot_start(tmp_path: Path, caplog: Any) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")  # the progress root cannot be made: init fails and says why
    callback = hf.VigilCallback(job="hf-nostart", progress_dir=str(blocked / "pages"))
    trainer = _trainer(tmp_path, 3, [callback])
    with caplog.at_level(logging.ERROR):
        result = trainer.train()
    assert result.global_step == 3
    assert vigil.agent.current() is None
    assert "vigil SDK failed to start" in caplog.text


def test_training_runs_and_ends_promptly_when_the_collector_is_not_there(tmp_path: Path) -> None:
    callback = hf.VigilCallback(
        job="hf-nocollector",
        collector=f"http://127.0.0.1:{free_port()}",
        progress_dir=str(tmp_path / "pages"),
        spool_dir=str(tmp_path / "spool"),
        shutdown_timeout_s=1.0,
    )
    trainer = _trainer(tmp_path, 3, [callback])
    started = time.monotonic()
    assert trainer.train().global_step == 3
    assert time.monotonic() - started < 60
    assert vigil.agent.current() is None
    assert any((tmp_path / "spool").iterdir())  # the records wait for the agent to send them


def test_a_session_of_the_users_own_is_used_and_left_running(tmp_path: Path) -> None:
    session = vigil.agent.init(
        job="hf-user", collector=None, output_dir=tmp_path / "out", progress_dir=tmp_path / "p"
    )
    assert session is not None
    trainer = _trainer(tmp_path, 2, [hf.VigilCallback()])
    trainer.train()
    assert vigil.agent.current() is session  # the user shuts it down, not the callback
    vigil.agent.shutdown()
    assert [r["step"] for r in _steps(tmp_path / "out" / "hf-user")] == [1, 2]


def test_an_sdk_failing_in_every_step_does_not_stop_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(step: int, *, tokens: int = 0) -> Any:
        raise RuntimeError("broken SDK")

    callback = hf.VigilCallback(
        job="hf-broken", output_dir=str(tmp_path / "out"), progress_dir=str(tmp_path / "p")
    )
    monkeypatch.setattr(vigil.agent, "step", broken)
    seen: list[int] = []

    class Errors(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            session = vigil.agent.current()
            seen.append(session.internal_errors if session else -1)

    result = _trainer(tmp_path, 3, [callback, Errors()]).train()
    assert result.global_step == 3
    assert seen == [1, 2, 3]  # each step's failure counted in the session's health


def test_bad_options_are_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        hf.VigilCallback(seq_len=0)
    with pytest.raises(ValueError, match="job"):
        hf.VigilCallback(job="a/b")


def test_alone_a_request_saves_at_the_step_end_it_is_seen_once_per_request() -> None:
    agreement = save_agreement.SaveAgreement()
    agreement.start()  # no process group: nothing to agree with
    assert agreement.save_now() is False
    agreement.request()
    assert [agreement.save_now(), agreement.save_now()] == [True, False]
    threads = [threading.Thread(target=agreement.request) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert agreement.save_now() is True  # two requests before one step end: one save
    agreement.close()


class PlainLM(torch.nn.Module):
    """A model whose forward takes no loss keywords: Trainer divides its loss per micro-batch
    by the accumulation steps instead of normalising it by the step's items."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = hf_job.model(layers=1, hidden=32)

    def forward(self, input_ids: Any, attention_mask: Any, labels: Any) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_a_model_without_loss_keywords_gets_the_mean_of_its_micro_batch_losses(
    tmp_path: Path,
) -> None:
    callback = hf.VigilCallback(
        job="hf-plainlm", output_dir=str(tmp_path / "out"), progress_dir=str(tmp_path / "p")
    )
    counted = StepLosses()
    trainer = hf_job.CountingTrainer(
        model=PlainLM(),
        args=_args(tmp_path, 3),
        train_dataset=hf_job.Samples(3 * 2 * hf_job.BATCH),
        data_collator=hf_job.collate,
        callbacks=[callback, counted],
    )
    counted.trainer = trainer
    trainer.train()
    assert not trainer.model_accepts_loss_kwargs
    steps = _steps(tmp_path / "out" / "hf-plainlm")
    assert [r["loss"] for r in steps] == pytest.approx(counted.losses, rel=1e-5)


class StepLosses(transformers.TrainerCallback):
    """What CountingTrainer's training_step returned, summed per optimizer step."""

    def __init__(self) -> None:
        self.trainer: hf_job.CountingTrainer | None = None
        self.losses: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None
        self.losses.append(self.trainer.step_loss)
        self.trainer.step_loss = 0.0
