"""Process groups named by what they are: DeviceMesh dimensions and `vigil.agent.label_group`.

One 4-rank gloo job (`_labels_job`, real processes through the public SDK) uses a 2-D
DeviceMesh ("dp", "tp"), a flattened 3-D mesh dimension ("dp_cp"), groups made by hand and
labelled with `label_group`, and a group labelled only after its first collectives; the test
reads the JSONL collective aggregates a user would read. A second real job (tests/realjobs
train.py, FSDP2 x tensor parallel on a 2 x 2 mesh, rank 3 twice as slow in backward, two ranks
per simulated node) is analysed with `vigil analyze` as a user runs it: the straggler finding
names the tp and dp groups it holds up by label, node and ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations import workers
from tests.realjobs import launch as launcher
from vigil import codec, schema

WORLD = 4
STEPS = 4
RELABEL_AFTER = 1  # the "late" group gets its label after this step's collectives


def _labels_job(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import vigil.agent

    workers.join(rank, WORLD, port, out, job="labels", timeout_s=60)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "cp"))
    dp_cp = mesh3["dp", "cp"]._flatten().get_group()
    # Hand-made groups: every rank creates both, each labels the one it is in.
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    mine = crossed[0] if rank in (0, 3) else crossed[1]
    vigil.agent.label_group(mine, "cross")
    late = dist.new_group(list(range(WORLD)))
    errors: dict[str, str] = {}
    for case, (group, label) in {
        "world": (dist.group.WORLD, "all"),
        "empty": (mine, ""),
        "long": (mine, "x" * 17),
        "colon": (mine, "tp:2"),
        "reserved": (mine, "world"),
        "not_a_group": (object(), "tp"),
        "not_a_str": (mine, 5),
    }.items():
        try:
            vigil.agent.label_group(group, label)
        except (TypeError, ValueError) as exc:
            errors[case] = f"{type(exc).__name__}: {exc}"
    for step in range(STEPS):
        with vigil.agent.step(step):
            t = torch.ones(8)
            for group in (mesh.get_group("tp"), mesh.get_group("dp"), dp_cp, mine, late):
                dist.all_reduce(t, group=group)
        if step == RELABEL_AFTER:
            vigil.agent.label_group(late, "late")
    vigil.agent.shutdown()
    Path(out, f"errors.rank{rank}.json").write_text(json.dumps(errors))
    dist.destroy_process_group()


def _aggs(folder: Path) -> dict[int, list[schema.CollectiveAggregate]]:
    by_rank: dict[int, list[schema.CollectiveAggregate]] = {}
    for path in sorted(folder.glob("**/rank-*.jsonl")):
        for line in path.read_bytes().splitlines():
            record = codec.decode_json(line)
            if isinstance(record, schema.CollectiveAggregate):
                by_rank.setdefault(record.rank, []).append(record)
    return by_rank


@pytest.fixture(scope="module")
def labels_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("labels")
    workers.spawn(_labels_job, out, WORLD, timeout_s=120)
    return out


def _names(aggs: list[schema.CollectiveAggregate], step: int) -> list[str]:
    return [a.group for a in aggs if a.step == step]


@pytest.mark.e2e
def test_groups_are_named_by_their_dimension_the_same_on_every_member(labels_run: Path) -> None:
    aggs = _aggs(labels_run)
    assert sorted(aggs) == list(range(WORLD))
    per_rank = {rank: _names(aggs[rank], STEPS - 1) for rank in range(WORLD)}
    # Each rank's ops, in issue order: mesh tp, mesh dp, flattened dp_cp, its cross pair, late.
    labels = {rank: [n.partition(":")[0] for n in names] for rank, names in per_rank.items()}
    assert all(v == ["tp", "dp", "dp_cp", "cross", "late"] for v in labels.values()), labels

    def same(position: int, *members: int) -> str:
        names = {per_rank[r][position] for r in members}
        assert len(names) == 1, names
        return names.pop()

    # tp {0,1} {2,3}; dp {0,2} {1,3}; dp_cp (pp=2 x dp=1 x cp=2) {0,1} {2,3}; cross {0,3} {1,2}.
    assert same(0, 0, 1) != same(0, 2, 3)
    assert same(1, 0, 2) != same(1, 1, 3)
    assert same(2, 0, 1) != same(2, 2, 3)
    assert same(3, 0, 3) != same(3, 1, 2)
    same(4, 0, 1, 2, 3)


@pytest.mark.e2e
def test_a_label_given_after_first_use_applies_from_then_on(labels_run: Path) -> None:
    for rank, aggs in _aggs(labels_run).items():
        late = [
            (a.step, a.group.partition(":")[0], a.last_seq)
            for a in aggs
            if a.group.startswith(("late:", "pg:"))
        ]
        # Unlabelled ("pg") for the first two steps, then "late" with its own sequence (the
        # same on every member, so hang analysis still lines members up).
        assert late == [(0, "pg", 1), (1, "pg", 2), (2, "late", 1), (3, "late", 2)], rank


@pytest.mark.e2e
def test_bad_labels_are_refused_with_a_clear_error(labels_run: Path) -> None:
    for rank in range(WORLD):
        errors = json.loads((labels_run / f"errors.rank{rank}.json").read_text())
        assert errors == {
            "world": "ValueError: the default process group is always labelled 'world'",
            "empty": "ValueError: a group label must not be empty",
            "long": f"ValueError: group label {'x' * 17!r} is 17 characters; at most 16",
            "colon": "ValueError: group label 'tp:2' may hold only letters, digits, '_', '-' "
            "and '.', starting with a letter or digit (':' separates the label from the "
            "group's id)",
            "reserved": "ValueError: group label 'world' is reserved (the default and "
            "unlabelled groups)",
            "not_a_group": "TypeError: label_group needs a torch.distributed ProcessGroup, "
            f"not {errors['not_a_group'].rpartition('not ')[2]}",
            "not_a_str": "TypeError: a group label is a str, not int",
        }
        assert errors["not_a_group"].endswith(">") and "object" in errors["not_a_group"]


def test_label_checks_need_no_process_group() -> None:
    import vigil.agent

    with pytest.raises(ValueError, match="must not be empty"):
        vigil.agent.label_group(object(), "")
    with pytest.raises(ValueError, match="at most 16"):
        vigil.agent.label_group(object(), "expert_data_parallel")
    with pytest.raises(TypeError, match=r"needs a torch\.distributed ProcessGroup"):
        vigil.agent.label_group(object(), "tp")


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_vigil_analyze_names_the_straggler_s_groups_by_dimension(tmp_path: Path) -> None:
    fault = {"kind": "slow", "rank": 3, "factor": 2.0, "where": "backward"}
    cases = [{"job": "mesh-slow", "steps": 36, "seed": 4, "fault": fault}]
    nodes = {r: {"VIGIL_NODE": f"node-{r // 2}"} for r in range(WORLD)}
    result = launcher.launch("fsdp_tp", cases, tmp_path, timeout_s=300, rank_env=nodes)
    assert result.exit_codes == [0] * WORLD, f"see {result.logs}"
    groups = {a.group.partition(":")[0] for aggs in _aggs(tmp_path).values() for a in aggs}
    assert {"tp", "dp"} <= groups, groups
    done = subprocess.run(
        [sys.executable, "-m", "vigil", "analyze", str(tmp_path / "mesh-slow"), "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    out = done.stdout
    assert "[straggler] rank 3 on node-1: compute straggler" in out, out
    assert (
        "it holds up the dp group across node-0, node-1 (ranks 1, 3) and the tp group of "
        "node-1 (ranks 2, 3)" in out
    ), out
