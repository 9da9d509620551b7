"""False alarms that jobs measured as ranks observe them exposed, on recorded-style records.

Each scenario is built record by record as the SDK ships it (step records and per-(group, op)
collective aggregates whose durations follow from when each member arrived), and each test
failed before its fix: a slow group named rank by rank or node by node beside its own finding,
an MFU drop raised a second time beside the straggler that explains it, transfer time that
counted the waits of a last arrival that changes from op to op.
"""

from __future__ import annotations

import numpy as np

from vigil import schema
from vigil.analyzer import arrays, engine

Kind = schema.FindingKind
TP, DP, LAYERS = 4, 4, 4  # 16 ranks: a tp group per host, dp groups across the hosts


def _mesh_job(
    *, steps: int = 40, slow_dp: float = 1.0, slow_rank: int = -1, factor: float = 1.0
) -> list[schema.Record]:
    """16 ranks on 4 hosts, tensor parallel within a host (an all-gather after each of 4
    layers) and data parallel across hosts (dp group g: the ranks r with r % 4 == g, one
    all-reduce after the last layer). Each rank's layers take 0.1 s with +-10 % jitter, so a
    different member arrives last at each tp op; every op ends at its last member's arrival
    plus its transfer time (tp 0.01 s, dp 0.1 s). From step 10 dp group 3 moves its bytes
    `slow_dp` x slower, and rank `slow_rank` computes `factor` x longer."""
    rng = np.random.default_rng(11)
    n = TP * DP
    out: list[schema.Record] = [schema.Job(job_id="mesh", name="mesh", world_size=n)]
    out += [schema.RankInfo(job_id="mesh", rank=r, node=f"host-{r // TP}") for r in range(n)]
    t = 1000.0
    for step in range(steps):
        layer = 0.1 * rng.uniform(0.9, 1.1, (n, LAYERS))
        if step >= 10 and slow_rank >= 0:
            layer[slow_rank] *= factor
        now = np.zeros(n)  # each rank's clock within the step
        tp_ops = np.zeros((n, LAYERS))
        for k in range(LAYERS):
            arrive = now + layer[:, k]
            end = arrive.reshape(DP, TP).max(axis=1).repeat(TP) + 0.01
            tp_ops[:, k], now = end - arrive, end
        dp_transfer = np.full(DP, 0.1)
        if step >= 10:
            dp_transfer[3] *= slow_dp
        by_group = now.reshape(DP, TP)  # row: host, column: dp group
        dp_end = by_group.max(axis=0) + dp_transfer
        dp_ops = dp_end[np.arange(n) % TP] - now
        ends = dp_end[np.arange(n) % TP]
        for r in range(n):
            compute = float(layer[r].sum())
            wait = float(tp_ops[r].sum() + dp_ops[r])
            out.append(schema.StepRecord(job_id="mesh", rank=r, step=step, start_s=t,
                                         end_s=t + float(ends[r]), forward_s=compute / 3,
                                         backward_s=compute * 2 / 3, comm_wait_s=wait,
                                         tokens=1024))  # fmt: skip
            ops = ((f"tp:{r // TP}", "all_gather", tp_ops[r]),
                   (f"dp:{r % TP}", "all_reduce", dp_ops[r:r + 1]))  # fmt: skip
            for group, op, durations in ops:
                out.append(schema.CollectiveAggregate(
                    job_id="mesh", rank=r, step=step, group=group, op=op,
                    count=durations.size, bytes=(1 << 20) * durations.size,
                    total_device_s=float(durations.sum()), max_device_s=float(durations.max()),
                    last_device_s=float(durations[-1]), last_seq=(step + 1) * durations.size,
                ))  # fmt: skip
        t += float(ends.max()) + 0.01
    return out


def _summaries(found: list[schema.Finding]) -> list[str]:
    return [f.summary for f in found]


def test_a_slow_group_is_one_slow_link_not_its_members_one_by_one() -> None:
    found = engine.analyze_records(_mesh_job(slow_dp=2.0))
    assert [(f.kind, f.subjects.ranks) for f in found] == [(Kind.SLOW_LINK, [3, 7, 11, 15])], (
        _summaries(found)
    )
    assert "moves its bytes" in found[0].summary  # the group's finding (links.py)


def test_a_straggler_holding_up_its_groups_is_no_slow_link() -> None:
    found = engine.analyze_records(_mesh_job(slow_rank=5, factor=1.5))
    assert [(f.kind, f.subjects.ranks) for f in found] == [(Kind.STRAGGLER, [5])], _summaries(found)


def test_a_clean_mesh_has_no_finding() -> None:
    assert _summaries(engine.analyze_records(_mesh_job())) == []


def test_transfer_time_is_each_ops_own_not_the_waits_of_changing_last_arrivals() -> None:
    """Per step each rank's transfer is its groups' shared time: 4 tp ops of 0.01 s and one
    dp op of 0.1 s, whoever arrives last at each."""
    a = arrays.from_records(_mesh_job(steps=12))
    np.testing.assert_allclose(a.transfer_s, 0.14, rtol=0.02)
