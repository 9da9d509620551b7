"""Slow links on recorded jobs: a CPU-loaded host is not a slow link, a tbf-limited one is.

Both fixtures are the SDK's own JSONL of a real 4-rank gloo job (`tests/realjobs/train.py`,
wrapper `fsdp_tp`: tensor parallel within pairs of ranks, FSDP2 across them):

- data/jsonl_loaded_host/: a clean job on one host with a busy process on every core (noise
  `cpu_hog`). Its intra-host `mesh_dp` groups took turns being slower than each other: one
  was 1.5x its peer in 8 of 12 steps, which the rule before intra-host groups got their own
  bar reported as a slow link.
- data/jsonl_tbf_link/: rank 3 in a network namespace of its own behind a veth pair that
  `tc tbf` limits to 200 Mbit/s (tests/realjobs/netns.py); the group it shares with rank 1
  crosses that link and moves its bytes ~5x slower in every step.
"""

from __future__ import annotations

from pathlib import Path

from vigil import codec, schema
from vigil.analyzer import arrays, config, links

DATA = Path(__file__).parent / "data"


def _arrays(folder: Path) -> arrays.StepArrays:
    records = [
        codec.decode_json(line)
        for path in sorted(folder.glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    return arrays.from_records(records)


def test_groups_on_one_cpu_loaded_host_are_no_slow_link() -> None:
    a = _arrays(DATA / "jsonl_loaded_host" / "fsdp_tp-cpu-hog")
    assert set(a.nodes) == {"vm"}  # every rank on one host
    assert links.detect(a, config.StragglerConfig()) == []


def test_the_same_groups_across_two_hosts_at_that_ratio_would_be_one() -> None:
    """The bar is the hosts', not the numbers': the loaded job's groups, told they span two
    hosts, cross a network bar of 1.2x in one persistent episode; on their one host not even
    that bar counts. (At the default 1.5x they cross neither: their transfer time is taken op
    by op, without the waits a loaded CPU adds whenever the last arrival changes.)"""
    cfg = config.StragglerConfig(link_ratio=1.2)
    a = _arrays(DATA / "jsonl_loaded_host" / "fsdp_tp-cpu-hog")
    assert links.detect(a, cfg) == []
    a.nodes = tuple("host-a" if r < 2 else "host-b" for r in a.ranks.tolist())
    found = links.detect(a, cfg)
    assert [f.kind for f in found] == [schema.FindingKind.SLOW_LINK]
    assert links.detect(a, config.StragglerConfig()) == []


def test_a_tbf_limited_link_is_found_between_its_hosts() -> None:
    a = _arrays(DATA / "jsonl_tbf_link" / "fsdp_tp-link")
    found = links.detect(a, config.StragglerConfig())
    assert len(found) == 1, [f.summary for f in found]
    link = found[0]
    assert link.subjects.ranks == [1, 3] and link.subjects.links == ["host-a<->host-b"]
    transfer = link.evidence[0]
    assert transfer.observed > links.INTRA_HOST_RATIO * transfer.baseline
