"""`vigil analyze PATH` over recorded folders: text, JSON, bad lines, missing paths, progress."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vigil import cli
from vigil.analyzer import offline


def test_text_report_names_the_straggler(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["analyze", str(data_dir / "jsonl_straggler")]) == 0
    out = capsys.readouterr().out
    assert "[straggler] rank 5 on node0001: compute straggler" in out
    assert "compute_time:" in out and "arrived_last_share:" in out


def test_json_report_of_a_hang_with_a_corrupt_line(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["analyze", "--json", str(data_dir / "jsonl_hang")]) == 0
    doc = json.loads(capsys.readouterr().out)
    [hang] = doc["findings"]
    assert (
        hang["kind"] == "hang"
        and hang["subjects"]["ranks"] == [6]
        and hang["job_id"] == "train-hang"
    )
    assert "all_reduce #26 of group 'dp'" in hang["summary"]
    [error] = doc["errors"]
    assert error["path"].endswith("rank-00000.jsonl:86") and "StepRecord.rank" in error["reason"]
    # py-spy and faulthandler dumps of the same stack land in one group; the culprit stands apart.
    assert [g["ranks"] for g in doc["stack_groups"]] == [[0, 1, 2, 3, 4, 5, 7], [6]]
    assert doc["stack_groups"][1]["frames"][1] == "__next__ (torch/utils/data/dataloader.py:631)"
    notes = [e["note"] for e in hang["evidence"] if e["metric"] == "stack_group_ranks"]
    assert notes[1].startswith("ranks [6]: _recv_bytes")


def test_kineto_folder_json_report(kineto_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", "--json", str(kineto_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    ranks = {(Path(t["path"]).name, t["rank"]): t for t in doc["traces"]}
    rank1 = ranks[("trace_filter_sampled_rank-1.json.gz", 1)]
    assert (rank1["idle_pct"], rank1["compute_pct"], rank1["non_compute_pct"]) == (
        54.72,
        22.57,
        22.72,
    )
    assert rank1["comm_comp_overlap_pct"] == 20.05
    assert any("CPU-only" in e["reason"] for e in doc["errors"])


def test_missing_path_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_progress_reports_bytes(data_dir: Path) -> None:
    seen: list[tuple[int, int]] = []
    offline.analyze_path(data_dir / "jsonl_straggler", progress=lambda d, t, _: seen.append((d, t)))
    total = seen[-1][1]
    assert seen[0][0] == 0 and seen[-1] == (total, total) and len(seen) == 9  # 8 files + done


@pytest.mark.integration
def test_vigil_analyze_entry_point(data_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vigil", "analyze", str(data_dir / "fr_gloo_hang" / "pickle")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "rank(s) [3] never entered gloo:all_reduce #4 of group '2'" in done.stdout
