"""`vigil analyze` when its inputs are missing or unreadable: what it says and its exit status."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vigil import cli


def test_a_folder_without_inputs_names_where_and_what_was_searched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.log").write_text("nothing vigil reads\n")
    assert cli.main(["analyze", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no input files under {tmp_path} (searched recursively)" in captured.err
    assert "its 1 file(s) are none of" in captured.err
    for pattern in ("*.jsonl", "*.json.gz", "Flight Recorder", "*stack*.txt"):
        assert pattern in captured.err


def test_an_empty_folder_and_a_foreign_file_are_explained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["analyze", str(tmp_path)]) == 2
    assert f"no input files under {tmp_path}" in capsys.readouterr().err
    other = tmp_path / "notes.log"
    other.write_text("x\n")
    assert cli.main(["analyze", str(other)]) == 2
    assert f"{other} is none of" in capsys.readouterr().err


@pytest.mark.parametrize("as_json", [False, True])
def test_when_every_input_is_unreadable_each_is_named_and_it_fails(
    as_json: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rank-00000.jsonl").write_text("garbage\n")
    (tmp_path / "trace_rank-1.json.gz").write_bytes(b"\x1f\x8b\x08\x00truncated")
    assert cli.main(["analyze", *(["--json"] if as_json else []), str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: none of the inputs could be analysed" in err
    assert f"{tmp_path / 'rank-00000.jsonl'}:1: " in err
    assert f"{tmp_path / 'trace_rank-1.json.gz'}: cannot read" in err


def test_when_some_inputs_are_unreadable_it_warns_naming_them_and_goes_on(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(data_dir / "jsonl_straggler", tmp_path / "run")
    broken = tmp_path / "run" / "rank-99999.jsonl"
    broken.write_text("garbage\n")
    assert cli.main(["analyze", "--json", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert "warning: skipped what could not be analysed in" in captured.err
    assert str(broken) in captured.err and captured.err.count("\n") == 1
    doc = json.loads(captured.out)
    assert any(f["kind"] == "straggler" for f in doc["findings"])
    assert [e["path"] for e in doc["errors"]] == [f"{broken}:1"]
