"""vigil.integrations.megatron against megatron-core 0.16.1 on 4 CPU ranks (gloo).

One launch of 4 real processes (`_megatron_job`): `initialize_model_parallel` with tp=2 x pp=2,
then (after `destroy_model_parallel`) dp=2 x tp=2; each time `label_groups()` labels every
group and the job all-reduces on the tp, pp, dp, dp_cp and mp groups inside SDK steps, so the
JSONL aggregates show what a user's findings will call them. Then the schedule wrapper:
Megatron's schedules cannot run on CPU (each allocates a CUDA tensor before the first
micro-batch; the job records where the real one stops), so `timed` is checked on a schedule
written here with Megatron's calling convention (`forward_step_func(data_iterator, model)` ->
(output, loss_func), the loss, backward), whose forward and backward take known times. The real
schedule is timed on a GPU by bench/gpu/megatron_check.py.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations import workers
from vigil import codec, schema

WORLD = 4
LAYOUTS = {"tp2_pp2": (2, 2), "dp2_tp2": (2, 1)}  # name -> (tp, pp); first steps 0, 10
FORWARD_S, BACKWARD_S, MICROBATCHES = 0.02, 0.03, 4
TIMED_STEPS = range(20, 24)
CORE = ("tp", "pp", "dp", "dp_cp", "mp")


class _Model:
    """What a Megatron model chunk offers its schedule (a config, set_input_tensor)."""

    def __init__(self) -> None:
        import torch
        from megatron.core.enums import ModelType
        from megatron.core.model_parallel_config import ModelParallelConfig

        self.layer = torch.nn.Linear(8, 8)
        self.config = ModelParallelConfig()
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor: Any) -> None:
        pass

    def __call__(self, x: Any) -> Any:
        return self.layer(x)


def _forward_step(data_iterator: Iterator[Any], model: _Model) -> tuple[Any, Any]:
    time.sleep(FORWARD_S)
    out = model(next(data_iterator))
    return out, lambda o: (o.square().mean(), {"loss": float(o.square().mean())})


def _schedule(
    *, forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int,
    seq_length: int, micro_batch_size: int, forward_only: bool = False,
) -> list[dict[str, float]]:  # fmt: skip
    """Megatron's no-pipelining order, per micro-batch: forward, loss, backward."""
    losses = []
    for _ in range(num_microbatches):
        out, loss_func = forward_step_func(data_iterator, model)
        loss, info = loss_func(out)
        if not forward_only:
            loss.backward()
            time.sleep(BACKWARD_S)
        losses.append(info)
    return losses


def _megatron_job(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import vigil.agent
    from vigil.integrations import megatron as vigil_megatron

    workers.join(rank, WORLD, port, out, job="megatron", timeout_s=120)
    result: dict[str, Any] = {}
    for n, (name, (tp, pp)) in enumerate(LAYOUTS.items()):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        result[name] = vigil_megatron.label_groups()
        groups = [
            ps.get_tensor_model_parallel_group(),
            ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(),
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_model_parallel_group(),
        ]
        for step in range(10 * n, 10 * n + 3):
            with vigil.agent.step(step):
                t = torch.ones(4)
                for group in groups:
                    dist.all_reduce(t, group=group)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = _Model()
    data = iter([torch.randn(2, 8) for _ in range(100)])
    timed = vigil_megatron.timed(_schedule)
    kwargs = dict(data_iterator=data, model=model, num_microbatches=MICROBATCHES)
    for step in TIMED_STEPS:
        with vigil.agent.step(step):
            timed(forward_step_func=_forward_step, seq_length=2, micro_batch_size=2, **kwargs)
        # An evaluation pass between steps is not training time of the next step.
        timed(forward_step_func=_forward_step, seq_length=2, micro_batch_size=2,
              forward_only=True, **kwargs)  # fmt: skip
    real = vigil_megatron.get_forward_backward_func()
    with vigil.agent.step(30):
        try:
            real(forward_step_func=_forward_step, seq_length=2, micro_batch_size=2, **kwargs)
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)
            megatron_frames = [f for f in frame if "megatron" in f.filename]
            last = megatron_frames[-1]
            result["real_schedule"] = {
                "error": f"{type(exc).__name__}: {exc}",
                "where": f"{Path(last.filename).name}:{last.lineno}",
                "line": last.line,
                "function": real.__name__,
            }
    ps.destroy_model_parallel()
    vigil.agent.shutdown()
    Path(out, f"result.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("megatron")
    workers.spawn(_megatron_job, out, WORLD, timeout_s=240)
    return out


def _result(run: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((run / f"result.rank{rank}.json").read_text()))


def _records(run: Path, rank: int) -> list[schema.Record]:
    (path,) = run.glob(f"**/rank-{rank:05d}.jsonl")
    return [codec.decode_json(line) for line in path.read_bytes().splitlines()]


pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_every_megatron_group_is_labelled_by_its_dimension(run: Path) -> None:
    for rank in range(WORLD):
        labels = _result(run, rank)
        pair, stage = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        # tp=2 x pp=2: Megatron's order is tp first, pp last.
        a = labels["tp2_pp2"]
        assert (a["tp"], a["pp"], a["dp"], a["mp"]) == (pair, stage, [rank], [0, 1, 2, 3])
        assert a["embd"] == stage  # the first and last stage hold the embeddings
        assert a.get("pos_embd") == ([rank] if rank in (0, 1) else None)  # the first stage's
        # dp=2 x tp=2: the data-parallel groups cross the tensor-parallel pairs.
        b = labels["dp2_tp2"]
        assert (b["tp"], b["dp"], b["pp"], b["mp"]) == (pair, stage, [rank], pair)
        for layout in (a, b):
            assert set(layout) >= {
                *CORE, "cp", "embd", "tp_dp", "tp_dp_cp", "tp_cp", "ep", "ep_tp",
                "ep_dp", "tp_ep_mp", "tp_ep_pp", "dp_gloo", "dp_cp_gloo", "ep_dp_gloo",
            }  # fmt: skip


def test_collectives_on_megatron_groups_carry_the_labels(run: Path) -> None:
    names: dict[tuple[int, int, str], str] = {}  # (step, rank, label) -> its group's name
    for rank in range(WORLD):
        aggs = [r for r in _records(run, rank) if isinstance(r, schema.CollectiveAggregate)]
        for step in (0, 10):
            mine = [a.group for a in aggs if a.step == step]
            assert [g.partition(":")[0] for g in mine] == list(CORE), (rank, mine)
            names.update({(step, rank, g.partition(":")[0]): g for g in mine})
    # Members of one group name it alike: ranks 0 and 1 share a tp group in both layouts, 0 and
    # 2 a pp group (first layout) or a dp group (second).
    assert names[0, 0, "tp"] == names[0, 1, "tp"] != names[0, 2, "tp"] == names[0, 3, "tp"]
    assert names[0, 0, "pp"] == names[0, 2, "pp"] != names[0, 1, "pp"] == names[0, 3, "pp"]
    assert names[10, 0, "dp"] == names[10, 2, "dp"] != names[10, 1, "dp"] == names[10, 3, "dp"]
    assert names[10, 0, "tp"] == names[10, 1, "tp"] != names[0, 0, "tp"]  # a new group


def test_the_schedule_s_forward_backward_and_whole_time_are_timed_per_step(run: Path) -> None:
    for rank in range(WORLD):
        steps = {r.step: r for r in _records(run, rank) if isinstance(r, schema.StepRecord)}
        for step in TIMED_STEPS:
            s = steps[step]
            # Four forwards of 20 ms each; the rest (loss, backward, 4 x 30 ms) is backward.
            assert MICROBATCHES * FORWARD_S <= s.forward_s < 1.75 * MICROBATCHES * FORWARD_S
            assert MICROBATCHES * BACKWARD_S <= s.backward_s < 2.5 * MICROBATCHES * BACKWARD_S
            # The evaluation pass after each step (forward_only, 4 more forwards) counted in no
            # step: the bound on forward time leaves no room for it.
            assert s.forward_s + s.backward_s <= s.step_time_s
            # The whole schedule is the stage's time inside a pipeline schedule (its waits for
            # its peers are in there): all of the step's time but the step's own boundaries.
            assert s.forward_s + s.backward_s <= s.pipeline_s <= s.step_time_s


def test_the_real_schedule_stops_on_cpu_where_the_docs_say(run: Path) -> None:
    for rank in range(WORLD):
        real = _result(run, rank)["real_schedule"]
        assert real["function"] == "forward_backward_no_pipelining"
        assert real["where"] == "schedules.py:596"
        assert real["line"] == 'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")'
        assert "CUDA" in real["error"]


def test_labelling_before_megatron_is_initialised_is_refused() -> None:
    pytest.importorskip("megatron.core")
    from vigil.integrations import megatron as vigil_megatron

    with pytest.raises(ValueError, match=r"call initialize_model_parallel\(\.\.\.\) before"):
        vigil_megatron.label_groups()


def test_megatron_group_descriptions_map_to_labels() -> None:
    from vigil.integrations import megatron as vigil_megatron

    assert vigil_megatron.label_for_desc("TENSOR_MODEL_PARALLEL_GROUP") == "tp"
    assert vigil_megatron.label_for_desc("HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L1") == "hcp_l1"
    assert vigil_megatron.label_for_desc("HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L0") == (
        "hep_dp_gloo_l0"
    )
    assert vigil_megatron.label_for_desc("HYBRID_DP_CP_GROUP_4") == "hdp_cp_4"
    assert vigil_megatron.label_for_desc("SOMETHING_ELSE") is None
    # Every label fits the SDK's rules (at most 16 characters, no ':').
    import vigil.agent.groups as sdk_groups

    for label in vigil_megatron.DESC_LABELS.values():
        assert sdk_groups.check_label(label) == label
