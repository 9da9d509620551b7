"""vigil names the slow, stuck or dead rank of real jobs it did not write.

Real 4-rank gloo processes run `train.py`, a user's own loop instrumented only through the
public SDK, under each parallel wrapper (DDP, FSDP2, DTensor TP, a 1F1B pipeline, a plain loop
calling dist.all_reduce). Each wrapper's launch runs its cases in turn: a clean jittery job, and
a 2x straggler in each position (before forward / a slow forward layer in the pipeline, a slow
layer in backward, the optimizer step, data loading inside `span("data")`); the pipeline's
launch also a 1.25x stage in the compute positions and 1.1x ones in backward and after its
optimizer step, the plain loop's an intermittent straggler (2x every 4th step) and a ramp (1 %
of a step more each step). Every case is analysed with `vigil analyze --json` as a user runs
it. Hangs and a crash run on the plain loop and DDP. The full matrix, with magnitudes down to
1.1x and the online analyzer, is `bench/faults.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.analyzer import recorded
from tests.realjobs import launch as launcher
from tests.realjobs import netns
from vigil.analyzer import arrays, config, stragglers

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(600)]

POSITIONS = ("forward", "backward", "optimizer", "data")
CULPRIT = {"forward": 1, "backward": 2, "optimizer": 3, "data": 0}
EXPECTED_KIND = {"forward": "straggler", "backward": "straggler", "optimizer": "straggler"}
PP_QUARTER = ("forward", "backward", "optimizer")  # 1.25x pipeline stragglers
PP_TENTH = ("backward", "optimizer")  # 1.1x pipeline stragglers where only the SDK sees them


def _analyze(folder: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "vigil", "analyze", str(folder), "--json", "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    return list(json.loads(done.stdout)["findings"])


def _steps(folder: Path) -> list[dict[str, Any]]:
    """Every step record the job's ranks wrote, as JSON."""
    return [
        json.loads(line)
        for path in sorted(folder.glob("rank-*.jsonl"))
        for line in path.read_text().splitlines()
        if '"type":"step"' in line
    ]


def _named(findings: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    return sorted({(f["kind"], tuple(f["subjects"].get("ranks", []))) for f in findings})  # type: ignore[misc]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One launch per wrapper: a clean case, then a 2x straggler in each position."""
    out = tmp_path_factory.mktemp("realjobs")
    pages = tmp_path_factory.mktemp("pages")
    for wrapper in ("ddp", "fsdp", "tp", "pp", "plain"):
        cases: list[dict[str, Any]] = [
            {"job": f"{wrapper}-clean", "steps": 36, "seed": 3, "noise": {"kind": "jitter"}}
        ]
        for where in POSITIONS:
            fault = {"kind": "slow", "rank": CULPRIT[where], "factor": 2.0, "where": where}
            cases.append({"job": f"{wrapper}-{where}", "steps": 36, "seed": 4, "fault": fault})
        if wrapper == "pp":  # a stage a quarter slower: its neighbours' waits must show it
            for where in PP_QUARTER:
                fault = {"kind": "slow", "rank": CULPRIT[where], "factor": 1.25, "where": where}
                # 40 faulty steps: at 28, a stage was missed in about one run in ten (its
                # flags, ~z 4 on 2 shared cores, reached 8 of 12 steps late or not at all).
                cases.append({"job": f"pp-{where}-1.25", "steps": 48, "seed": 5, "fault": fault})
            # A stage a tenth slower after its optimizer step (outside its schedule) and in
            # its backward passes (inside it, where its peers wait for it).
            for where in PP_TENTH:
                fault = {"kind": "slow", "rank": CULPRIT[where], "factor": 1.1, "where": where}
                cases.append({"job": f"pp-{where}-1.1", "steps": 40, "seed": 5, "fault": fault})
        if wrapper == "plain":  # the shape of a rank's slowness: some steps, or more and more
            every = {"kind": "slow", "rank": 3, "factor": 2.0, "every": 4}
            ramp = {"kind": "slow", "rank": 2, "ramp": 0.01}
            # 40 faulty steps, 10 slow ones: the period's evidence needs 6 on one phase (at 28,
            # one CI run beside other busy processes found none).
            cases.append({"job": "plain-intermittent", "steps": 48, "seed": 6, "fault": every})
            cases.append({"job": "plain-ramp", "steps": 46, "seed": 6, "fault": ramp})
        result = launcher.launch(wrapper, cases, out, progress_dir=pages, timeout_s=400)
        assert result.exit_codes == [0, 0, 0, 0], f"{wrapper}: see {result.logs}"
    return {p.name: p for p in out.iterdir() if p.is_dir()}


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "tp", "pp", "plain"])
def test_a_clean_jittery_job_has_no_finding(runs: dict[str, Path], wrapper: str) -> None:
    assert _analyze(runs[f"{wrapper}-clean"]) == []


@pytest.mark.parametrize("where", POSITIONS)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "tp", "pp", "plain"])
def test_the_slow_rank_is_named_wherever_it_is_slow(
    runs: dict[str, Path], wrapper: str, where: str
) -> None:
    found = _analyze(runs[f"{wrapper}-{where}"])
    kind = EXPECTED_KIND.get(where, "data_stall")
    assert _named(found) == [(kind, (CULPRIT[where],))], [f["summary"] for f in found]
    finding = found[0]
    signal = finding["evidence"][0]
    assert signal["observed"] > signal["baseline"]  # the evidence moved the right way
    if kind == "straggler":
        wait = next(e for e in finding["evidence"] if e["metric"] == "comm_wait_time")
        assert wait["observed"] < wait["baseline"]  # the straggler waits least
    assert finding["step_start"] <= 8 + 20  # reported within 20 steps of the fault's onset
    assert "intermittent" not in finding["summary"] and "growing" not in finding["summary"]


@pytest.mark.parametrize(
    ("job", "rank", "says"),
    [
        ("plain-intermittent", 3, "(every 4th step;"),
        ("plain-ramp", 2, ", its excess over its peers growing from "),
    ],
)
def test_a_straggler_says_whether_it_is_slow_now_and_then_or_more_and_more(
    runs: dict[str, Path], job: str, rank: int, says: str
) -> None:
    """2x every 4th step reads ~1.1x in the episode's median, and a ramp its average: the
    summary says how the slowness is spread (analyzer/shape.py)."""
    found = _analyze(runs[job])
    assert _named(found) == [("straggler", (rank,))], [f["summary"] for f in found]
    assert says in found[0]["summary"], found[0]["summary"]


@pytest.mark.parametrize("where", PP_QUARTER)
def test_a_pipeline_stage_a_quarter_slower_is_named(runs: dict[str, Path], where: str) -> None:
    """1F1B on gloo: the other stages block in receives, batched exchanges and sends whose
    launch writes the socket; all of it counts as their wait, so the slow stage's compute
    stands out.

    It is named while the fault lasts (steps 8-47), not always within the 20 steps the other
    cases are held to: this is the noise edge of 4 stages on 2 shared cores. In 26 of 27 kept
    runs (test launches and `bench/faults.py` matrices) a 1.25x stage was flagged 1-7 steps
    after onset; in one CI run the backward stage scored z ~3 for 16 steps (the last stage's
    own heavier compute widened the 4 ranks' spread) and was flagged 21 steps after onset. A
    rule that flags it sooner (compute and wait z summing to 5) named a clean pipeline's last
    stage in 22,500 clean steps, so it was not kept (README, limitations)."""
    found = _analyze(runs[f"pp-{where}-1.25"])
    assert _named(found) == [("straggler", (CULPRIT[where],))], [f["summary"] for f in found]
    signal = found[0]["evidence"][0]
    assert signal["observed"] > signal["baseline"]
    assert found[0]["step_start"] <= 8 + 30


def test_a_pipeline_stage_a_tenth_slower_after_its_optimizer_step_is_named(
    runs: dict[str, Path],
) -> None:
    """The SDK times torch.distributed.pipelining's schedules (`StepRecord.pipeline_s`): a
    stage waits for its peers inside its schedule, so its time outside it, less its waits
    there, is its own. The last stage spins 10 % of a step after its optimizer step: its
    forward time does not grow and its peers wait for it inside their schedules; its own time
    outside its schedule grows (analyzer/forward_shift.py, `outside_shift`)."""
    folder = runs["pp-optimizer-1.1"]
    steps = _steps(folder)
    assert len(steps) == 4 * 40
    assert all(0 < s["pipeline_s"] < s["end_s"] - s["start_s"] for s in steps)
    found = _analyze(folder)
    assert _named(found) == [("straggler", (CULPRIT["optimizer"],))], [f["summary"] for f in found]
    head = found[0]["evidence"][0]
    assert head["observed"] > head["baseline"]
    assert found[0]["step_start"] <= 8 + 20
    # Its own time outside flags it (whether or not its compute, against its peers', also
    # did: the finding then says compute_time), and no other stage's.
    _flagged_alone_by(folder, "outside", CULPRIT["optimizer"])


def test_a_pipeline_stage_a_tenth_slower_in_its_backward_passes_is_named(
    runs: dict[str, Path],
) -> None:
    """The SDK times the stage's backward passes (`StepRecord.stage_backward_s`): the
    schedule receives a chunk's gradients before the chunk's backward runs, so their time less
    the waits in them is the stage's own. A layer of stage 2 spins 10 % of a step in its
    backward passes: its peers wait for it inside their schedules, and its forward time and
    its time outside do not grow; its own backward time does (`backward_shift`)."""
    folder = runs["pp-backward-1.1"]
    steps = _steps(folder)
    assert all(0 < s["stage_backward_s"] < s["pipeline_s"] for s in steps)
    found = _analyze(folder)
    assert _named(found) == [("straggler", (CULPRIT["backward"],))], [f["summary"] for f in found]
    assert found[0]["step_start"] <= 8 + 20
    _flagged_alone_by(folder, "backward", CULPRIT["backward"])


def _flagged_alone_by(folder: Path, signal: str, rank: int) -> None:
    """`rank`'s shift in `signal` (a `stragglers.Scores` field: `outside`, `backward`) is
    flagged in enough steps, from within 20 of the fault's onset, and no other rank's is."""
    a = arrays.from_records(recorded.records(folder))
    cfg = config.StragglerConfig()
    scores = stragglers.score(a, cfg)
    shifted = scores.forward & getattr(scores, signal)
    culprit = int(np.searchsorted(a.ranks, rank))
    assert shifted[:, culprit].sum() >= cfg.min_hits
    assert int(a.steps[np.flatnonzero(shifted[:, culprit])[0]]) <= 8 + 20
    assert not np.delete(shifted, culprit, axis=1).any()


def test_hangs_and_a_crash_name_their_rank(tmp_path: Path) -> None:
    """Bounded 6 s hangs (before a collective, inside one no peer joins, in data loading, in
    a checkpoint save its peers finish) on DDP, one inside a collective on the 1F1B pipeline,
    then a crash (os._exit) in a launch of its own on the plain loop."""
    cases = [
        {
            "job": f"hang-{where}",
            "steps": 20,
            "seed": 5,
            "fault": {"kind": "hang", "rank": 2, "step": 12, "seconds": 6.0, "where": where},
        }
        for where in ("before", "collective", "data", "checkpoint")
    ]
    result = launcher.launch("ddp", cases, tmp_path, timeout_s=300)
    assert result.exit_codes == [0, 0, 0, 0], f"see {result.logs}"
    for case in cases:
        found = _analyze(tmp_path / case["job"])
        assert _named(found) == [("hang", (2,))], [f["summary"] for f in found]
        silent = found[0]["evidence"][0]
        assert silent["metric"] == "seconds_without_progress" and silent["observed"] < 6.0
    # A pipeline's point-to-point pairs (batch_isend_irecv names peers by group rank).
    pp = [{**cases[1], "job": "pp-hang-collective"}]
    result = launcher.launch("pp", pp, tmp_path, timeout_s=300)
    assert result.exit_codes == [0, 0, 0, 0], f"see {result.logs}"
    found = _analyze(tmp_path / "pp-hang-collective")
    assert _named(found) == [("hang", (2,))], [f["summary"] for f in found]
    crash = [
        {"job": "crash", "steps": 30, "seed": 6, "fault": {"kind": "crash", "rank": 3, "step": 12}}
    ]
    result = launcher.launch("plain", crash, tmp_path, timeout_s=300)
    assert result.exit_codes[3] == 13 and all(c != 0 for c in result.exit_codes)
    found = _analyze(tmp_path / "crash")
    assert _named(found) == [("crash", (3,))], [f["summary"] for f in found]


@pytest.mark.skipif(not netns.available(), reason="needs root, iproute2 and network namespaces")
def test_a_real_slow_link_is_located_between_its_hosts(tmp_path: Path) -> None:
    """Rank 3 of a 2-D job (tensor parallel within pairs, FSDP2 across) sits in a network
    namespace of its own behind a veth pair that `tc tbf` limits to 200 Mbit/s: its traffic,
    and only its, crosses the slow link. The same job without the limit has no finding."""
    cases = [{"job": "link", "steps": 30, "seed": 7}]
    with netns.slow_link("200mbit") as link:
        outside = {"VIGIL_NODE": "host-a", "GLOO_SOCKET_IFNAME": link.outside_dev}
        env = {r: dict(outside) for r in range(4)}
        env[3] = {"VIGIL_NODE": "host-b", "GLOO_SOCKET_IFNAME": link.inside_dev}
        result = launcher.launch(
            "fsdp_tp", cases, tmp_path / "slow", timeout_s=300, rank_env=env,
            rank_prefix={3: link.prefix}, master_addr=link.outside_addr,
        )  # fmt: skip
    assert result.exit_codes == [0, 0, 0, 0], f"see {result.logs}"
    found = _analyze(tmp_path / "slow" / "link")
    assert found and {f["kind"] for f in found} == {"slow_link"}, [f["summary"] for f in found]
    for finding in found:  # each slow group crosses the link: rank 3 and one partner
        assert 3 in finding["subjects"]["ranks"] and len(finding["subjects"]["ranks"]) == 2
        assert finding["subjects"]["links"] == ["host-a<->host-b"]
        transfer = finding["evidence"][0]
        assert transfer["observed"] > 1.5 * transfer["baseline"]
    result = launcher.launch("fsdp_tp", cases, tmp_path / "clean", timeout_s=300)
    assert result.exit_codes == [0, 0, 0, 0], f"see {result.logs}"
    assert _analyze(tmp_path / "clean" / "link") == []
