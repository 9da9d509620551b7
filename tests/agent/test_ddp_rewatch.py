"""A DDP model watched again by a later session in the same process (a second run in one
notebook or script): DDP takes one comm hook for its lifetime, so vigil's hook from the first
`watch` stays and must time the second session's all-reduces, without a warning that says they
are not timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import sys, torch, torch.distributed as dist
import vigil.agent
from vigil.recovery.local import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for job in ("first", "second"):
    vigil.agent.init(job=job, collector=None, output_dir=sys.argv[1], progress_dir=sys.argv[2])
    vigil.agent.watch(model, opt)
    for i in range(3):
        with vigil.agent.step(i):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    vigil.agent.shutdown()
del model, opt
dist.destroy_process_group()
"""


def test_a_second_session_times_the_same_ddp_models_all_reduces(tmp_path: Path) -> None:
    out, pages = tmp_path / "out", tmp_path / "pages"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), str(pages)],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "comm hook" not in done.stderr, done.stderr
    for job in ("first", "second"):
        lines = (out / job / "rank-00000.jsonl").read_text().splitlines()
        aggs = [json.loads(x) for x in lines if '"coll_agg"' in x]
        assert sorted(a["step"] for a in aggs if a["op"] == "ddp_all_reduce") == [0, 1, 2], job
