"""Single-process behaviour: recipes, fault specs and their effects, data determinism, NaN
handling, and checkpoint/stop requests arriving between steps (as the SDK delivers them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer import workers
from vigil.trainer import checkpoint, data, faults, loop, recipes
from vigil.trainer.exits import ExitCode


def test_fault_specs_round_trip_and_reject_typos() -> None:
    plan = [
        faults.fail_at(1, 5),
        faults.hang_at(0, 7, "collective"),
        faults.slow(2, 3.0, from_step=4),
        faults.stall_at(3, 2, seconds=1.5),
        faults.nan_at(0, 6, attempt=1),
    ]
    assert faults.parse(faults.to_spec(plan)) == plan
    with pytest.raises(ValueError, match="bad fault field 'stpe=3'"):
        faults.parse("crash:rank=1,stpe=3")
    with pytest.raises(ValueError, match="needs factor >= 1"):
        faults.parse("slow:rank=0,factor=0.5")


def test_injector_slows_stalls_and_only_fires_in_its_attempt() -> None:
    slept: list[float] = []
    plan = faults.parse(
        "slow:rank=1,factor=3,step=2;stall:rank=1,step=4,seconds=2;crash:rank=0,step=1"
    )
    injector = faults.Injector(plan, rank=1, sleep=slept.append)
    injector.after_compute(1, 0.5)  # before the slow fault's first step: no delay
    injector.after_compute(2, 0.5)
    injector.on_data(3)
    injector.on_data(4)
    assert slept == [pytest.approx(1.0), 2.0]
    exits: list[int] = []
    rank0 = faults.Injector(plan, rank=0, exit_process=exits.append)
    rank0.at_step_start(1)
    assert exits == [faults.CRASH_EXIT_CODE]
    restarted = faults.Injector(plan, rank=0, attempt=1, exit_process=exits.append)
    restarted.at_step_start(1)
    assert exits == [faults.CRASH_EXIT_CODE]  # attempt 1 does not crash again


def test_the_global_batch_is_the_same_for_every_dp_size() -> None:
    def source(dp_rank: int, dp_size: int) -> data.BatchSource:
        return data.BatchSource(
            seed=3, seq_len=16, vocab=256, global_batch=8, dp_rank=dp_rank, dp_size=dp_size,
            device=torch.device("cpu"),
        )  # fmt: skip

    whole = source(0, 1).batch(5)
    quarters = [source(r, 4).batch(5) for r in range(4)]
    assert torch.equal(torch.cat([q.inputs for q in quarters]), whole.inputs)
    assert torch.equal(whole.labels[:, :-1], whole.inputs[:, 1:])
    assert not torch.equal(source(0, 1).batch(6).inputs, whole.inputs)


def test_byte_corpus_trains_on_a_text_file(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    recipe = recipes.named("tiny", steps=6, data=recipes.DataConfig(text_path=text), log_every=100)
    with loop.trainer_session(recipe, ctx=loop.RunContext()) as trainer:
        result = trainer.train()
    assert result.exit_code is ExitCode.OK
    assert result.losses[6] < result.losses[1]
    batch = data.BatchSource(
        seed=1, seq_len=8, vocab=256, global_batch=1, dp_rank=0, dp_size=1,
        device=torch.device("cpu"), text_path=text,
    ).batch(1)  # fmt: skip
    assert bytes(batch.inputs[0].tolist()).decode() in text.read_text()


def test_nan_loss_skips_the_step_and_persistent_nan_stops_the_run() -> None:
    recipe = recipes.named("tiny", steps=6)
    with loop.trainer_session(
        recipe, ctx=loop.RunContext(), fault_plan=[faults.nan_at(0, 3)]
    ) as trainer:
        once = trainer.train()
    assert once.exit_code is ExitCode.OK
    skipped = [s.step for s in once.history if s.skipped]
    assert skipped == [3]
    assert all(torch.isfinite(torch.tensor(s.loss)) for s in once.history if s.step != 3)
    plan = [faults.nan_at(0, s) for s in (2, 3, 4)]
    with loop.trainer_session(recipe, ctx=loop.RunContext(), fault_plan=plan) as trainer:
        stuck = trainer.train()
    assert stuck.exit_code is ExitCode.NONFINITE_LOSS
    assert stuck.history[-1].step == 2 + loop.MAX_NONFINITE_STEPS - 1


def test_checkpoint_and_stop_requests_take_effect_at_the_next_step(tmp_path: Path) -> None:
    recipe = workers.with_checkpoint(recipes.named("tiny", steps=6), directory=tmp_path)
    with loop.trainer_session(recipe, ctx=loop.RunContext()) as trainer:
        trainer.control.request_checkpoint()  # what the SDK's "checkpoint" control calls
        result = trainer.train(stop_after=3)
    assert result.exit_code is ExitCode.OK
    assert checkpoint.committed_steps(tmp_path) == [1, 3]
    with loop.trainer_session(recipe, ctx=loop.RunContext()) as trainer:
        trainer.control.request_stop()  # what SIGTERM calls
        stopped = trainer.train()
    assert stopped.exit_code is ExitCode.STOPPED
    assert stopped.start_step == 3 and checkpoint.committed_steps(tmp_path)[-1] == 4


def test_recipe_shapes_and_flops() -> None:
    one_b = recipes.named("1b")
    assert 1.0e9 < one_b.model.num_params() < 1.6e9
    eight_b = recipes.named("8b").model.num_params()
    assert 7.5e9 < eight_b < 8.5e9
    assert 65e9 < recipes.named("70b").model.num_params() < 75e9
    tiny = recipes.named("tiny").model
    n = tiny.num_params(include_embedding=False)
    assert tiny.flops_per_token(32) == 6 * n + 12 * 2 * 4 * 16 * 32
    with pytest.raises(ValueError, match="tp=3 must divide"):
        recipes.named("tiny", parallel=recipes.ParallelConfig(tp=3))


def test_bf16_autocast_trains_close_to_fp32() -> None:
    fp32 = recipes.named("tiny", steps=4)
    bf16 = fp32.replace(precision=recipes.Precision.BF16)
    with loop.trainer_session(fp32, ctx=loop.RunContext()) as trainer:
        want = trainer.train().losses
    with loop.trainer_session(bf16, ctx=loop.RunContext()) as trainer:
        got = trainer.train().losses
    for step, value in want.items():
        assert got[step] == pytest.approx(value, abs=0.05), step  # bf16 has ~3 digits
    assert got != want  # it really ran in bf16


def test_a_hang_before_the_collective_stops_the_rank_at_its_step() -> None:
    slept: list[float] = []
    injector = faults.Injector([faults.hang_at(1, 4, seconds=30.0)], rank=1, sleep=slept.append)
    injector.at_step_start(3)
    assert slept == []
    injector.at_step_start(4)  # a bounded hang returns after its seconds; 0 means forever
    assert slept == [30.0]
