"""Flight Recorder dumps: real gloo recordings and NCCL-layout dumps, both encodings."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from vigil.analyzer import flight_recorder as fr
from vigil.analyzer import offline


def _load(folder: Path) -> list[fr.Dump]:
    return [fr.load(p) for p in sorted(folder.iterdir())]


@pytest.mark.parametrize("encoding", ["pickle", "json"])
def test_gloo_dump_names_the_rank_that_never_entered(data_dir: Path, encoding: str) -> None:
    dumps = _load(data_dir / "fr_gloo_hang" / encoding)
    assert {d.backend for d in dumps} == {"gloo"}
    assert all(d.members == {} for d in dumps)  # gloo's pg_config carries no ranks
    [hang] = fr.analyze(dumps, job_id="j")
    assert hang.kind == "hang" and hang.subjects.ranks == [3]
    assert "all_reduce #4 of group '2'" in hang.summary and "3 rank(s) wait" in hang.summary


def test_gloo_pickle_stacks_are_grouped_by_identity(data_dir: Path) -> None:
    dumps = _load(data_dir / "fr_gloo_hang" / "pickle")
    stacks = {d.rank: d.entries[-1].frames for d in dumps}
    groups = fr.group_stacks(stacks)
    assert [ranks for ranks, _ in groups] == [[0, 1], [2], [3]]
    assert groups[0][1][0].startswith("all_reduce")
    [hang] = fr.analyze(dumps, job_id="j")
    notes = [e.note for e in hang.evidence if e.metric == "stack_group_ranks"]
    assert notes[0].startswith("ranks [0, 1]:")


@pytest.mark.parametrize("encoding", ["pickle", "json"])
def test_nccl_dump_with_states_and_pg_config(data_dir: Path, encoding: str) -> None:
    dumps = _load(data_dir / "fr_nccl_hang" / encoding)
    assert {d.backend for d in dumps} == {"nccl"}
    assert dumps[0].members == {"0": [0, 1, 2, 3], "1": [0, 1]}
    [hang] = fr.analyze(dumps, job_id="j")
    assert hang.subjects.ranks == [1]
    assert "nccl:all_reduce #6 of group '0'" in hang.summary


def test_desync_names_the_rank_with_the_other_op(data_dir: Path) -> None:
    found = fr.analyze(_load(data_dir / "fr_nccl_desync" / "json"), job_id="j")
    desync = next(f for f in found if "desync" in f.summary)
    assert desync.subjects.ranks == [2] and "nccl:broadcast" in desync.summary


def test_corrupt_dump_is_named_and_the_rest_analysed(data_dir: Path) -> None:
    report = offline.analyze_path(data_dir / "fr_corrupt")
    assert [Path(e.path).name for e in report.errors] == ["gloo_trace_rank_0"]
    assert "truncated" in report.errors[0].reason
    assert report.num_dumps == 3
    assert [f.subjects.ranks for f in report.findings] == [[3]]


def test_pickles_that_reference_classes_are_refused(tmp_path: Path) -> None:
    hostile = tmp_path / "nccl_trace_rank_0"
    hostile.write_bytes(pickle.dumps({"entries": [], "hook": print}))  # a global reference
    with pytest.raises(fr.DumpError, match=r"refusing to load builtins\.print"):
        fr.load(hostile)


def test_rank_must_be_in_the_file_name(tmp_path: Path) -> None:
    dump = tmp_path / "trace.json"
    dump.write_text('{"version": "2.4", "pg_config": {}, "entries": []}')
    with pytest.raises(fr.DumpError, match="cannot tell the rank"):
        fr.load(dump)
    assert fr.load(dump, rank=7).rank == 7
