"""vigil inside a real Lightning Trainer: `VigilCallback` on DDP and FSDP2, 2 and 4 gloo ranks.

`lightning_job.py` is a user's job (a tiny GPT-style decoder, synthetic padded batches, the real
`lightning.pytorch.Trainer`) that counts its own steps, tokens and losses beside vigil. One
module fixture starts, side by side: DDP with `accumulate_grad_batches=2` and an operator's
"checkpoint" request (`vigil agent --request`) mid-run; the same job without vigil; FSDP2
(Lightning's ModelParallelStrategy) with accumulation, a checkpoint request and a collector
that is down. Then a 4-rank DDP job with a straggler, alone (the detector compares each rank
with the others' median, so it needs at least 3 ranks: with 2, each is as far from their
median as the other). Lightning's FSDPStrategy (FSDP1) needs CUDA: see
`test_fsdp1_strategy_on_cuda`, which skips here.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from vigil import flops, schema
from vigil.integrations import save_agreement
from vigil.recovery.local import free_port

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(600)]

JOB = Path(__file__).with_name("lightning_job.py")
STEPS, ACCUMULATE, REQUEST_AT = 24, 2, 3
STRAGGLER_STEPS, STRAGGLER = 32, 2
JSON = ["--json", "--no-progress"]


def _start(
    out: Path, nproc: int, args: list[str], rank_args: dict[int, list[str]] | None = None
) -> list[subprocess.Popen[bytes]]:
    """Start `nproc` ranks of lightning_job.py the way torchrun does (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, a fresh MASTER_PORT); each rank's output in out/rank-<r>.log;
    `rank_args`: more arguments for some ranks."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(JOB), "--out", str(out), *args]
        cmd += (rank_args or {}).get(rank, [])
        with open(out / f"rank-{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], out: Path, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    codes = [p.returncode for p in procs]
    logs = "\n".join((out / f"rank-{r}.log").read_text()[-3000:] for r in range(len(procs)))
    assert codes == [0] * len(procs), f"exit codes {codes}:\n{logs}"


def _records(out: Path, job: str, rank: int) -> list[dict[str, Any]]:
    lines = (out / job / f"rank-{rank:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _own(out: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((out / f"job.rank{rank}.json").read_text()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lightning")
    pages = str(tmp_path_factory.mktemp("pages"))
    common = ["--steps", str(STEPS), "--accumulate", str(ACCUMULATE), "--progress-dir", pages]
    request = ["--request-checkpoint-at", str(REQUEST_AT)]
    down = ["--collector", f"http://127.0.0.1:{free_port()}", "--also-jsonl"]  # nobody there
    launches = {
        "ddp": (2, [*common, *request, "--job", "lt-ddp"]),
        "plain": (2, [*common, "--no-vigil"]),
        "fsdp2": (
            2,
            [*common, *request, "--job", "lt-fsdp2", "--strategy", "fsdp2", *down],
        ),
    }
    # FSDP2's rank 1 cannot start its SDK (its progress folder would be under a file): it
    # trains without vigil beside a rank 0 with it, and still joins the agreed save.
    blocked = root / "not-a-folder"
    blocked.write_text("")
    broken = {"fsdp2": {1: ["--progress-dir", str(blocked / "pages")]}}
    started = {
        name: _start(root / name, n, args, broken.get(name)) for name, (n, args) in launches.items()
    }
    for name, procs in started.items():
        _wait(procs, root / name)
    slow = ["--steps", str(STRAGGLER_STEPS), "--job", "lt-straggler", "--progress-dir", pages]
    slow += ["--slow-rank", str(STRAGGLER), "--slow-s", "0.12", "--slow-from", "8"]
    _wait(_start(root / "straggler", 4, slow), root / "straggler")
    return {name: root / name for name in [*launches, "straggler"]}


def _flops_per_token() -> float:
    from tests.integrations import lightning_job as job
    from vigil.integrations.lightning import model_params

    module = job.TinyGPT(slow_rank=-1, slow_s=0.0, slow_from=0)
    shape = schema.ModelShape(
        params=model_params(module), layers=job.LAYERS, hidden=job.HIDDEN, seq_len=job.SEQ
    )
    return flops.flops_per_token(shape)


@pytest.mark.parametrize(
    ("run", "job", "ranks"), [("ddp", "lt-ddp", [0, 1]), ("fsdp2", "lt-fsdp2", [0])]
)
def test_one_step_record_per_optimizer_step_with_the_jobs_own_numbers(
    runs: dict[str, Path], run: str, job: str, ranks: list[int]
) -> None:
    per_token = _flops_per_token()
    for rank in ranks:
        own = _own(runs[run], rank)
        assert own["global_step"] == STEPS
        steps = [r for r in _records(runs[run], job, rank) if r["type"] == "step"]
        # Lightning's numbering: the global_step each step's training_step calls saw.
        assert [r["step"] for r in steps] == [s["global_step"] for s in own["steps"]]
        assert [r["step"] for r in steps] == list(range(STEPS))
        # Tokens: the attention masks of both micro-batches (padding left out), as the job
        # counted them in training_step.
        assert [r["tokens"] for r in steps] == [s["tokens"] for s in own["steps"]]
        assert all(r["tokens"] < ACCUMULATE * 8 * 32 for r in steps)  # padding not counted
        # The loss: the micro-batches' mean, as the job computed it (Lightning hands the
        # callback each one divided by accumulate_grad_batches).
        for record, mine in zip(steps, own["steps"], strict=True):
            assert record["loss"] == pytest.approx(mine["loss"], rel=1e-5)
        assert all(r["model_flops"] == pytest.approx(per_token * r["tokens"]) for r in steps)
        assert all(r["mfu"] > 0 for r in steps)
        assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in steps)
        # The optimizer phase is the optimizer's alone (not the whole step): shorter than
        # forward and backward together, by the median (one step preempted on a loaded host
        # can take longer in any phase).
        assert all(r["optimizer_s"] > 0 for r in steps)
        assert statistics.median(r["optimizer_s"] for r in steps[1:]) < statistics.median(
            r["forward_s"] + r["backward_s"] for r in steps[1:]
        )
        ended = [r for r in _records(runs[run], job, rank) if r["type"] == "heartbeat"][-1]
        assert ended["state"] == "finished"


@pytest.mark.parametrize(
    ("run", "job", "ranks", "ops"),
    [
        # Lightning skips DDP's sync (no_sync) in the micro-batches that do not step.
        ("ddp", "lt-ddp", [0, 1], {"ddp_all_reduce": 1}),
        # FSDP2 gathers parameters in every micro-batch's forward and backward.
        (
            "fsdp2",
            "lt-fsdp2",
            [0],
            {"all_gather_single": 2 * ACCUMULATE, "reduce_scatter_single": 1},
        ),
    ],
)
def test_the_strategys_collectives_are_recorded_every_step(
    runs: dict[str, Path], run: str, job: str, ranks: list[int], ops: dict[str, int]
) -> None:
    for rank in ranks:
        aggs = [r for r in _records(runs[run], job, rank) if r["type"] == "coll_agg"]
        for op, least in ops.items():
            mine = [a for a in aggs if a["op"] == op]
            assert sorted({a["step"] for a in mine}) == list(range(STEPS)), op
            assert all(a["bytes"] > 0 and a["count"] >= least for a in mine), (op, mine)
            assert all(a["group"] == "world" or a["group"].startswith("pg:") for a in mine)


def test_a_checkpoint_request_saves_one_lightning_checkpoint(runs: dict[str, Path]) -> None:
    """`vigil agent --request checkpoint` reaches each rank's page on its own; the ranks agree
    and save once, one step end after the first rank saw it (the agreement is read a step late
    so that it never stalls one), in rounds at most MAX_GAP_STEPS step ends apart: global step
    REQUEST_AT + 1 to REQUEST_AT + MAX_GAP_STEPS, one more when no rank saw the request at the
    boundary it was sent in."""
    from tests.integrations import lightning_job as job

    saved = sorted((runs["ddp"] / "checkpoints").iterdir())
    latest = min(REQUEST_AT + 1 + save_agreement.MAX_GAP_STEPS, STEPS)
    due = [[f"vigil-step={step}.ckpt"] for step in range(REQUEST_AT + 1, latest + 1)]
    assert [p.name for p in saved] in due
    assert _own(runs["ddp"], 0)["checkpoints"] == _own(runs["ddp"], 1)["checkpoints"]
    assert _own(runs["ddp"], 0)["checkpoints"] == [str(saved[0])]
    checkpoint = torch.load(saved[0], map_location="cpu", weights_only=False)
    step = int(saved[0].name.split("=")[1].split(".")[0])
    assert checkpoint["global_step"] == step
    module = job.TinyGPT(slow_rank=-1, slow_s=0.0, slow_from=0)
    module.load_state_dict(checkpoint["state_dict"])  # a checkpoint Lightning can resume from
    assert checkpoint["optimizer_states"] and checkpoint["loops"]
    # FSDP2: a distributed checkpoint, every rank's shard written, also by the rank whose SDK
    # did not start (the request reached rank 0 only).
    (sharded,) = (runs["fsdp2"] / "checkpoints").iterdir()
    assert [sharded.name] in due
    names = {p.name for p in sharded.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"} <= names


def test_training_is_unaffected_without_a_collector_and_with_one_down(
    runs: dict[str, Path],
) -> None:
    """With the callback (JSON lines, no collector) the job trains as it does without vigil:
    the same losses step by step; with a collector nobody answers (rank 0) and an SDK that
    could not start (rank 1), FSDP2 trains to the end."""
    for rank in range(2):
        plain = _own(runs["plain"], rank)["steps"]
        watched = _own(runs["ddp"], rank)["steps"]
        assert [s["tokens"] for s in watched] == [s["tokens"] for s in plain]
        for a, b in zip(watched, plain, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert not (runs["plain"] / "lt-ddp").exists()
        down = _own(runs["fsdp2"], rank)
        assert down["global_step"] == STEPS and down["finite"]
    assert not (runs["fsdp2"] / "lt-fsdp2" / "rank-00001.jsonl").exists()
    assert "vigil SDK failed to start" in (runs["fsdp2"] / "rank-1.log").read_text()


def test_a_straggler_rank_is_named_by_vigil_analyze(runs: dict[str, Path]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vigil", "analyze", str(runs["straggler"] / "lt-straggler"), *JSON],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    found = json.loads(done.stdout)["findings"]
    named = sorted({(f["kind"], tuple(f["subjects"].get("ranks", []))) for f in found})
    assert named == [("straggler", (STRAGGLER,))], [f["summary"] for f in found]
    wait = next(e for e in found[0]["evidence"] if e["metric"] == "comm_wait_time")
    assert wait["observed"] < wait["baseline"]  # the straggler waits least
    steps = [r for r in _records(runs["straggler"], "lt-straggler", 0) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(STRAGGLER_STEPS))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp1_strategy_on_cuda(tmp_path: Path) -> None:
    """Lightning's FSDPStrategy (FSDP1) on CUDA, one rank per GPU (at most 2) over NCCL.

    Not run on CPU: Lightning refuses it there (`The strategy fsdp requires a GPU accelerator`,
    lightning/pytorch/trainer/connectors/accelerator_connector.py `_check_strategy_and_fallback`),
    and past that check torch's FSDP1 stops at `_init_device_handle` (torch/distributed/fsdp/
    _init_utils.py: `FSDP needs a non-CPU accelerator device`); `--strategy fsdp-cpu` shows it."""
    nproc = min(2, torch.cuda.device_count())
    args = ["--steps", "4", "--accumulate", "2", "--job", "lt-fsdp1", "--strategy", "fsdp"]
    args += ["--accelerator", "cuda", "--progress-dir", str(tmp_path / "pages")]
    _wait(_start(tmp_path, nproc, args), tmp_path)
    for rank in range(nproc):
        own = _own(tmp_path, rank)
        steps = [r for r in _records(tmp_path, "lt-fsdp1", rank) if r["type"] == "step"]
        assert [r["step"] for r in steps] == list(range(4))
        assert [r["tokens"] for r in steps] == [s["tokens"] for s in own["steps"]]
        aggs = {r["op"] for r in _records(tmp_path, "lt-fsdp1", rank) if r["type"] == "coll_agg"}
        if nproc > 1:
            assert {"all_gather_into_tensor", "reduce_scatter_tensor"} & aggs


@pytest.mark.skipif(
    not hasattr(importlib.import_module("vigil.agent.sdk"), "checkpoint_committed"),
    reason="this SDK has no vigil.agent.checkpoint_committed",
)
def test_rank_0_reports_the_saved_checkpoint(runs: dict[str, Path]) -> None:
    """The Checkpoint record the recovery controller waits for: once, from rank 0, naming the
    file and the last step it holds (global step - 1, numbered as the step records are)."""
    (saved,) = (runs["ddp"] / "checkpoints").iterdir()
    step = int(saved.name.split("=")[1].split(".")[0])
    reports = [r for r in _records(runs["ddp"], "lt-ddp", 0) if r["type"] == "checkpoint"]
    assert [(r["step"], r["location"]) for r in reports] == [(step - 1, str(saved.resolve()))]
    assert reports[0]["bytes"] == saved.stat().st_size and reports[0]["save_s"] > 0
    assert not [r for r in _records(runs["ddp"], "lt-ddp", 1) if r["type"] == "checkpoint"]
