"""vigil on a user's GPT script it did not write (`gpt_job.py`), launched by torchrun.

The script compiles its model with `torch.compile` before DDP wraps it, accumulates gradients
over four micro-steps with DDP's all-reduce only on the last, clips gradients, evaluates every
20 iterations (an all-reduce between steps), and saves checkpoints and prints its loss on rank 0
alone, between steps. vigil is added as the README says, nothing more. One torchrun launch runs
a clean job, a rank spinning a quarter of an iteration longer after each forward pass, a rank
whose data loading stalls, and a healthy job whose evaluation lasts 25 s, whose rank-0 save 6 s
and whose model recompiles mid-run for a new input shape (no iteration ends meanwhile, and
nothing is hung); each is analysed with `vigil analyze --json` as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("gpt_job.py")
ITERS = 40
CASES: list[dict[str, Any]] = [
    {"job": "gpt-clean", "iters": ITERS},
    {"job": "gpt-slow", "iters": ITERS, "slow": {"rank": 2, "factor": 1.25, "where": "forward"}},
    {"job": "gpt-data", "iters": ITERS, "slow": {"rank": 1, "factor": 2.0, "where": "data"}},
    # A healthy job whose evaluation (every rank) lasts 25 s and whose rank-0 save lasts 6 s,
    # both between iterations, and whose micro-batches shrink at iteration 32 (torch.compile
    # recompiles inside it): no step ends for a while each time, yet nothing is hung.
    {"job": "gpt-pauses", "iters": ITERS, "eval_s": 25.0, "save_s": 6.0, "reshape_at": 32},
]
EXPECTED = {
    "gpt-clean": [],
    "gpt-slow": [("straggler", [2])],
    "gpt-data": [("data_stall", [1])],
    "gpt-pauses": [],
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("userscript")
    out, record = base / "vigil-output", base / "script"
    cases = base / "cases.json"
    cases.write_text(json.dumps(CASES))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")},
        "VIGIL_OUTPUT_DIR": str(out),
        "VIGIL_PROGRESS_DIR": str(base / "pages"),
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += ["--log-dir", str(base / "torchrun")]  # not a fresh folder left in /tmp
    cmd += [str(SCRIPT), "--cases", str(cases), "--record", str(record), "--compile"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, record


def _records(folder: Path, rank: int) -> list[dict[str, Any]]:
    lines = (folder / f"rank-{rank:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_the_script_ran_compiled_and_saved_on_rank_0_only(launched: tuple[Path, Path]) -> None:
    _, record = launched
    for case in CASES:
        seen = [json.loads((record / case["job"] / f"rank{r}.json").read_text()) for r in range(4)]
        assert all(s["iterations"] == ITERS and s["compiled_graphs"] > 0 for s in seen)
        assert [s["checkpoints"] for s in seen] == [["ckpt-25.pt"], [], [], []]


def test_one_step_per_iteration_with_the_synced_micro_step_s_all_reduce(
    launched: tuple[Path, Path],
) -> None:
    out, _ = launched
    for case in CASES:
        for rank in range(4):
            records = _records(out / case["job"], rank)
            steps = [r for r in records if r["type"] == "step"]
            assert [r["step"] for r in steps] == list(range(ITERS))
            assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in steps)
            sizes = [6 if r["step"] >= case.get("reshape_at", ITERS) else 8 for r in steps]
            assert [r["tokens"] for r in steps] == [4 * size * 64 for size in sizes]
            assert all(r["loss"] > 0 for r in steps)
            ddp = [r for r in records if r["type"] == "coll_agg" and r["op"] == "ddp_all_reduce"]
            # Every iteration all-reduces its buckets once, on the last micro-step only: as
            # many buckets each step, never four times as many (DDP rebuilds its buckets
            # after the first iteration).
            per_step = {r["step"]: r["count"] for r in ddp}
            assert sorted(per_step) == list(range(ITERS))
            assert len({per_step[i] for i in range(1, ITERS)}) == 1, per_step


def test_vigil_names_the_slow_rank_and_the_stalled_loader_and_nothing_on_the_clean_job(
    launched: tuple[Path, Path],
) -> None:
    out, _ = launched
    for job, expected in EXPECTED.items():
        done = subprocess.run(
            [sys.executable, "-m", "vigil", "analyze", str(out / job), "--json", "--no-progress"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        findings = json.loads(done.stdout)["findings"]
        named = sorted({(f["kind"], tuple(f["subjects"].get("ranks", []))) for f in findings})
        assert [(kind, list(ranks)) for kind, ranks in named] == expected, (
            job,
            [f["summary"] for f in findings],
        )
