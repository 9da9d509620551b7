"""`VigilCallback` in real Hugging Face Trainer jobs: 3 CPU ranks on gloo, DDP made by accelerate.

One launch of `hf_job.py` (a user's Trainer script: tiny GPT-2 from a config, random weights,
variable-length padded samples, gradient_accumulation_steps=2) runs its cases in turn: a clean
job, during which the test asks every rank for a checkpoint through its progress page once they
are past step 2 (what `vigil agent --request checkpoint` and the node agent do), a job with a 3x
straggler on rank 1, a job asking Trainer for FSDP on CPU, and a job where vigil cannot start
on rank 2 while a checkpoint request reaches the others. Three ranks, not two:
with two, the median of each step's compute is the mean of the two ranks and the straggler
detector's robust z-score (median/MAD) cannot exceed 0.7, whichever rank is slow.

FSDP: accelerate 1.15.0 applies an FSDP plugin only for multi-accelerator distributed types.
`AcceleratorState.__init__` (accelerate/state.py) sets `DistributedType.FSDP` inside the branch
for MULTI_GPU, MULTI_XPU, MULTI_NPU, ... and MULTI_CPU is not among them, so on CPU/gloo
`TrainingArguments(fsdp=...)` trains with DDP without a word (the third case checks that this is
still so). The FSDP run of the same job is the `gpu` test below, skipped without two GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from vigil.agent import progress
from vigil.integrations import save_agreement
from vigil.recovery.local import free_port

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(400)]

JOB = Path(__file__).with_name("hf_job.py")
NPROC = 3
STEPS = 24
# A request after step 2 is saved by step 19 at the latest (rounds at step ends 1, 2, 18).
PARTIAL_STEPS = 22
SLOW_RANK = 1
CHECKPOINT_AFTER = 2
FSDP_SKIP = (
    "accelerate 1.15.0 enables FSDP only for multi-accelerator distributed types "
    "(AcceleratorState.__init__ in accelerate/state.py sets DistributedType.FSDP for MULTI_GPU, "
    "MULTI_XPU, ..., not MULTI_CPU): on CPU/gloo Trainer(fsdp=...) trains with DDP; needs 2 GPUs"
)


def launch(
    cases: list[dict[str, Any]],
    out: Path,
    *,
    nproc: int,
    extra: list[str] | None = None,
    during: Callable[[], object] = lambda: None,
) -> list[int]:
    """Start `nproc` ranks of hf_job.py the way torchrun does (calling `during()` while they
    run); their exit codes."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "cases.json"
    spec.write_text(json.dumps(cases))
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(JOB), "--out", str(out), "--cases", str(spec)]
        cmd += ["--progress-dir", str(out / "pages"), *(extra or [])]
        with open(out / f"rank-{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(10)  # the others see their collectives fail
            break
        during()
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [int(p.returncode) for p in procs]


class CheckpointRequest:
    """Asks every rank of `job` for a checkpoint once all are past `after` (once)."""

    def __init__(self, pages: Path, job: str, after: int, nproc: int) -> None:
        self.pages, self.job, self.after, self.nproc = pages, job, after, nproc
        self.sent_at: int | None = None  # the furthest rank's last step when it was sent

    def __call__(self) -> None:
        if self.sent_at is not None:
            return
        readers = [progress.PageReader(p) for p in progress.discover(self.pages, self.job)]
        try:
            steps = [r.snapshot().last_step for r in readers]
            if len(steps) == self.nproc and min(steps) >= self.after:
                for reader in readers:
                    reader.request_control("checkpoint")
                self.sent_at = max(steps)
        finally:
            for reader in readers:
                reader.close()


def records(folder: Path, rank: int, kind: str) -> list[dict[str, Any]]:
    folder = folder.parent / "vigil" / folder.name  # the SDK's files of that job
    lines = (folder / f"rank-{rank:05d}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def job_log(folder: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((folder / f"job.rank{rank}.json").read_text()))


def analyze(folder: Path) -> list[tuple[str, tuple[int, ...]]]:
    folder = folder.parent / "vigil" / folder.name
    done = subprocess.run(
        [sys.executable, "-m", "vigil", "analyze", str(folder), "--json", "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    found = json.loads(done.stdout)["findings"]
    return sorted({(f["kind"], tuple(f["subjects"].get("ranks", []))) for f in found})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    cases = [
        {"job": "hf-clean", "steps": STEPS, "grad_accum": 2},
        {
            "job": "hf-straggler",
            "steps": 32,
            "grad_accum": 2,
            "slow": {"rank": SLOW_RANK, "factor": 3.0},
        },
        {"job": "hf-fsdp-on-cpu", "steps": 2, "grad_accum": 1, "parallel": "fsdp"},
        {"job": "hf-partial", "steps": PARTIAL_STEPS, "grad_accum": 1, "no_vigil_rank": NPROC - 1},
    ]
    requests = [
        CheckpointRequest(out / "pages", "hf-clean", CHECKPOINT_AFTER, NPROC),
        CheckpointRequest(out / "pages", "hf-partial", CHECKPOINT_AFTER, NPROC - 1),
    ]
    codes = launch(cases, out, nproc=NPROC, during=lambda: [ask() for ask in requests])
    assert codes == [0] * NPROC, f"see {out}/rank-*.log"
    for request in requests:
        assert request.sent_at is not None, f"{request.job} ended before step {request.after}"
        (out / request.job / "requested-at").write_text(str(request.sent_at))
    return out


def test_one_step_record_per_optimizer_step_with_the_jobs_own_tokens_and_loss(runs: Path) -> None:
    for job in ("hf-clean", "hf-straggler"):
        folder = runs / job
        for rank in range(NPROC):
            mine = job_log(folder, rank)["steps"]
            steps = records(folder, rank, "step")
            assert [r["step"] for r in steps] == [s["step"] for s in mine]
            assert [r["step"] for r in steps] == list(range(1, len(mine) + 1))
            assert [r["tokens"] for r in steps] == [s["tokens"] for s in mine]
            for record, counted in zip(steps, mine, strict=True):
                assert record["loss"] == pytest.approx(counted["loss"], rel=1e-5)
                assert record["forward_s"] > 0 and record["backward_s"] > 0
                assert record["mfu"] > 0 and record["model_flops"] > 0
    # Ranks train on different, differently padded samples: per-rank counts really differ.
    tokens = {
        rank: [s["tokens"] for s in job_log(runs / "hf-clean", rank)["steps"]]
        for rank in range(NPROC)
    }
    assert len({tuple(t) for t in tokens.values()}) == NPROC


def test_ddp_gradient_all_reduce_is_recorded_every_step(runs: Path) -> None:
    for rank in range(NPROC):
        aggs = records(runs / "hf-clean", rank, "coll_agg")
        ddp = [a for a in aggs if a["op"] == "ddp_all_reduce"]
        assert sorted({a["step"] for a in ddp}) == list(range(1, STEPS + 1))
        # No all-reduce in the first micro-batch (no_sync): the same buckets once per step.
        assert len({a["count"] for a in ddp}) == 1
        assert all(a["bytes"] > 0 and a["total_device_s"] > 0 for a in ddp)


def test_the_straggler_is_named_and_the_clean_job_has_no_finding(runs: Path) -> None:
    assert analyze(runs / "hf-straggler") == [("straggler", (SLOW_RANK,))]
    assert analyze(runs / "hf-clean") == []


def test_a_checkpoint_request_makes_every_rank_save_one_trainer_checkpoint(runs: Path) -> None:
    logs = [job_log(runs / "hf-clean", rank) for rank in range(NPROC)]
    folders = logs[0]["checkpoints"]
    assert len(folders) == 1, folders  # save_strategy="no": only the request saved
    step = int(folders[0].removeprefix("checkpoint-"))
    requested_at = int((runs / "hf-clean" / "requested-at").read_text())
    # Seen at each rank's next step end, agreed at the next round (MAX_GAP_STEPS apart at most)
    # and read a step after it: saved 2 to MAX_GAP_STEPS + 1 steps later.
    assert requested_at < step <= min(requested_at + 2 + save_agreement.MAX_GAP_STEPS, STEPS)
    saved = runs / "hf-clean" / "trainer" / folders[0]
    # Each rank writes its own RNG state into the folder of the step it saved at: all agreed.
    assert sorted(p.name for p in saved.glob("rng_state_*.pth")) == [
        f"rng_state_{rank}.pth" for rank in range(NPROC)
    ]
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["global_step"] == step
    # Rank 0 tells vigil (the controller's "checkpoint now" waits for this record); only rank 0.
    reported = [records(runs / "hf-clean", rank, "checkpoint") for rank in range(NPROC)]
    assert [(r["step"], r["location"]) for r in reported[0]] == [(step, str(saved))]
    assert reported[1:] == [[]] * (NPROC - 1)
    assert (saved / "model.safetensors").stat().st_size > 0


def test_a_rank_where_vigil_cannot_start_trains_on_and_still_saves_with_its_peers(
    runs: Path,
) -> None:
    """Rank 2 has no session; the others record their steps, and the request they got is
    saved by all three at one step (rank 2 still takes part in the agreement)."""
    folder = runs / "hf-partial"
    for rank in range(NPROC - 1):
        steps = [r["step"] for r in records(folder, rank, "step")]
        assert steps == list(range(1, PARTIAL_STEPS + 1))
    assert not (runs / "vigil" / "hf-partial" / f"rank-{NPROC - 1:05d}.jsonl").exists()
    assert len(job_log(folder, NPROC - 1)["steps"]) == PARTIAL_STEPS  # it trained every step
    (saved,) = job_log(folder, 0)["checkpoints"]
    assert int(saved.removeprefix("checkpoint-")) > int((folder / "requested-at").read_text())
    assert len(list((folder / "trainer" / saved).glob("rng_state_*.pth"))) == NPROC


def test_each_training_leaves_no_thread_of_vigils_behind(runs: Path) -> None:
    """Each case's session and checkpoint agreement (a gloo group of its own: its loop and run
    threads) end with its training: after the first case (which made the process group) every
    case leaves the process the threads it found (counted once the case's threads have ended,
    up to 3 s after it), give or take one (a group left behind would add three a case)."""
    cases = ["hf-clean", "hf-straggler", "hf-fsdp-on-cpu", "hf-partial"]
    for rank in range(NPROC):
        after = [job_log(runs / case, rank)["threads_after"] for case in cases]
        assert max(after) <= after[0] + 1, (rank, after)


def test_fsdp_asked_of_trainer_on_cpu_still_trains_with_ddp(runs: Path) -> None:
    """The reason the FSDP run below needs GPUs (module docstring): if accelerate starts
    sharding on CPU this fails, and the FSDP case should run here."""
    for rank in range(NPROC):
        log = job_log(runs / "hf-fsdp-on-cpu", rank)
        assert (log["fsdp"], log["wrapper"]) == (False, "DistributedDataParallel")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=FSDP_SKIP)
def test_fsdp2_job_on_gpus_records_its_collectives_and_saves_on_request(tmp_path: Path) -> None:
    cases = [{"job": "hf-fsdp", "steps": 12, "grad_accum": 2}]
    extra = ["--parallel", "fsdp", "--device", "cuda"]
    request = CheckpointRequest(tmp_path / "pages", "hf-fsdp", 2, 2)
    codes = launch(cases, tmp_path, nproc=2, extra=extra, during=request)
    assert codes == [0, 0], f"see {tmp_path}"
    folder = tmp_path / "hf-fsdp"
    for rank in range(2):
        log = job_log(folder, rank)
        assert log["fsdp"]
        steps = records(folder, rank, "step")
        assert [r["step"] for r in steps] == [s["step"] for s in log["steps"]]
        # The mask is on the GPU there: counted by its size, padding included (no device sync).
        assert [r["tokens"] for r in steps] == [s["positions"] for s in log["steps"]]
        ops = {a["op"] for a in records(folder, rank, "coll_agg")}
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= ops
    assert len(job_log(folder, 0)["checkpoints"]) == 1
