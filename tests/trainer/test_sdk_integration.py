"""The trainer under the real SDK: step records with losses land in the SDK's JSONL output, and a
"checkpoint" request written into the rank's progress page (as the node agent does) is saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.receiver import Receiver
from tests.trainer import workers
from vigil import schema
from vigil.agent import progress
from vigil.env import EnvVar
from vigil.trainer import checkpoint, loop, recipes, telemetry


def test_sdk_records_steps_and_its_checkpoint_request_is_honoured(tmp_path: Path) -> None:
    recipe = workers.with_checkpoint(recipes.named("tiny", steps=4), directory=tmp_path / "ckpt")
    tele = telemetry.Telemetry()
    tele.start(
        job="sdk-ctl",
        rank=0,
        world_size=1,
        model_shape=recipe.model.shape(recipe.seq_len),
        flops_per_token=recipe.model.flops_per_token(recipe.seq_len),
        peak_flops=1e12,
        output_dir=tmp_path / "out",
        collector=None,
        progress_dir=tmp_path / "pages",
    )
    with loop.trainer_session(recipe, ctx=loop.RunContext(job_id="sdk-ctl"), tele=tele) as trainer:
        page = progress.PageReader(progress.page_path(tmp_path / "pages", "sdk-ctl", 0))
        page.request_control("checkpoint")
        result = trainer.train()
        page.close()
    # Seen at step 1's boundary, agreed by every rank in step 2, saved after step 2.
    assert checkpoint.committed_steps(tmp_path / "ckpt") == [2, 4]
    assert tele.errors == 0
    lines = (tmp_path / "out" / "sdk-ctl" / "rank-00000.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["loss"] for r in steps] == [result.losses[s] for s in (1, 2, 3, 4)]
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in steps)
    # Each commit is reported through the SDK (what the recovery controller waits for).
    commits = [r for r in map(json.loads, lines) if r["type"] == "checkpoint"]
    assert [(r["step"], Path(r["location"]).name) for r in commits] == [
        (s, checkpoint.step_dir(tmp_path / "ckpt", s).name) for s in (2, 4)
    ]
    assert all(r["bytes"] > 0 and r["committed_s"] > 0 for r in commits)


def test_without_collector_option_the_trainer_ships_to_the_collector_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`vigil train` documents "--collector URL (else VIGIL_COLLECTOR_URL)": no option given
    must still reach the collector named in the environment (the SDK takes None as "none")."""
    receiver = Receiver()
    monkeypatch.setenv(EnvVar.COLLECTOR_URL, receiver.url)
    recipe = recipes.named("tiny", steps=2)
    tele = telemetry.Telemetry()
    try:
        tele.start(
            job="sdk-env",
            rank=0,
            world_size=1,
            model_shape=recipe.model.shape(recipe.seq_len),
            flops_per_token=recipe.model.flops_per_token(recipe.seq_len),
            peak_flops=1e12,
            output_dir=tmp_path / "out",
            collector=None,
            progress_dir=tmp_path / "pages",
        )
        with loop.trainer_session(
            recipe, ctx=loop.RunContext(job_id="sdk-env"), tele=tele
        ) as trainer:
            trainer.train()
    finally:
        receiver.stop()
    steps = [r for r in receiver.records if isinstance(r, schema.StepRecord)]
    assert {r.job_id for r in steps} == {"sdk-env"}
    assert not (tmp_path / "out" / "sdk-env").exists()  # shipped, not written to JSONL
