"""The recovery policy, row by row: every finding kind at every reachable severity."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from vigil.recovery import policy
from vigil.recovery.policy import Budget, Context, Severity, decide
from vigil.schema import ActionKind as A
from vigil.schema import Evidence, Finding, FindingKind, Subjects

NOW = 10_000.0


def finding(
    kind: FindingKind,
    *,
    slowdown: float | None = None,
    confidence: float = 0.9,
    nodes: tuple[str, ...] = ("node-1",),
) -> Finding:
    evidence = [] if slowdown is None else [Evidence(metric="slowdown", observed=slowdown)]
    return Finding(
        finding_id=f"f-{kind}",
        kind=kind,
        job_id="job",
        confidence=confidence,
        subjects=Subjects(ranks=[2, 3], nodes=list(nodes)),
        evidence=evidence,
    )


# (kind, slowdown evidence) -> (severity, actions with one spare node, actions with no spare and
# dp=4, actions with no spare and dp already at its minimum). Written out by hand, row by row.
C, D, S, K, R, M, Z = (
    A.CHECKPOINT,
    A.DIAGNOSE,
    A.DUMP_STACKS,
    A.CORDON,
    A.RESTART,
    A.MIGRATE,
    A.RESIZE,
)
EXPECTED: dict[tuple[FindingKind, float | None], tuple[Severity, list[A], list[A], list[A]]] = {
    (FindingKind.CRASH, None): (Severity.CRITICAL, [R], [R], [R]),
    (FindingKind.HANG, None): (Severity.CRITICAL, [S, R], [S, R], [S, R]),
    (FindingKind.NODE_FAULT, None): (Severity.CRITICAL, [C, K, M], [C, K, Z], [C, K, R]),
    (FindingKind.SDC, None): (Severity.CRITICAL, [C, K, M], [C, K, Z], [C, K, R]),
    (FindingKind.STRAGGLER, 1.1): (Severity.LOW, [D], [D], [D]),
    (FindingKind.STRAGGLER, 1.3): (Severity.MEDIUM, [D], [D], [D]),
    (FindingKind.STRAGGLER, 2.0): (Severity.HIGH, [C, D, M], [C, D, Z], [C, D, R]),
    (FindingKind.STRAGGLER, None): (Severity.LOW, [D], [D], [D]),
    (FindingKind.SLOW_LINK, 1.1): (Severity.LOW, [], [], []),
    (FindingKind.SLOW_LINK, None): (Severity.MEDIUM, [D], [D], [D]),
    (FindingKind.SLOW_LINK, 1.6): (Severity.HIGH, [C, D, M], [C, D, Z], [C, D, R]),
    (FindingKind.DATA_STALL, None): (Severity.MEDIUM, [S], [S], [S]),
    (FindingKind.DATA_STALL, 3.0): (Severity.HIGH, [S], [S], [S]),
    (FindingKind.MFU_DROP, None): (Severity.MEDIUM, [D], [D], [D]),
    (FindingKind.MFU_DROP, 1.5): (Severity.HIGH, [D], [D], [D]),
    (FindingKind.STAGE_IMBALANCE, None): (Severity.LOW, [], [], []),
    (FindingKind.SEQLEN_IMBALANCE, None): (Severity.LOW, [], [], []),
    # The controller's own report of a job it will not restart: nothing to act on.
    (FindingKind.RECOVERY_UNSAFE, None): (Severity.LOW, [], [], []),
}


def test_every_finding_kind_has_rows() -> None:
    assert {kind for kind, _ in EXPECTED} == set(FindingKind)


@pytest.mark.parametrize(("kind", "slowdown"), list(EXPECTED), ids=lambda v: str(v))
def test_row(kind: FindingKind, slowdown: float | None) -> None:
    sev, with_spare, no_spare, at_min = EXPECTED[(kind, slowdown)]
    f = finding(kind, slowdown=slowdown)
    assert policy.severity(f) is sev
    contexts = [
        Context(now_s=NOW, spare_nodes=1, dp_size=4),
        Context(now_s=NOW, spare_nodes=0, dp_size=4),
        Context(now_s=NOW, spare_nodes=0, dp_size=1),
    ]
    for ctx, expected in zip(contexts, (with_spare, no_spare, at_min), strict=True):
        decision = decide(f, ctx)
        assert [a.kind for a in decision.actions] == expected, ctx
        assert decision.suppressed == ""
        assert all(a.reason for a in decision.actions)


def test_slowdown_is_read_from_time_like_evidence() -> None:
    """The analyzer reports e.g. compute_time 0.42 s against a 0.06 s median: 7x slower."""
    f = Finding(
        finding_id="s",
        kind=FindingKind.STRAGGLER,
        job_id="job",
        confidence=0.9,
        subjects=Subjects(ranks=[2], nodes=["node-1"]),
        evidence=[
            Evidence(metric="compute_time", observed=0.42, baseline=0.06, unit="s"),
            Evidence(metric="comm_wait_time", observed=0.15, baseline=0.52, unit="s"),
            Evidence(metric="arrived_last_share", observed=1.0, baseline=0.25),
        ],
    )
    assert policy.slowdown_factor(f) == pytest.approx(7.0)
    assert policy.severity(f) is Severity.HIGH
    mild = msgspec.structs.replace(
        f, evidence=[Evidence(metric="compute_time", observed=0.13, baseline=0.1, unit="s")]
    )
    assert policy.severity(mild) is Severity.MEDIUM


def test_table_rows_only_use_known_steps() -> None:
    for (kind, sev), steps in policy.TABLE.items():
        assert isinstance(kind, FindingKind) and isinstance(sev, Severity)
        assert steps and all(isinstance(s, policy.Step) for s in steps)


def test_migrate_targets_each_culprit_node_and_resize_names_new_dp() -> None:
    f = finding(FindingKind.NODE_FAULT, nodes=("node-2", "node-1"))
    decision = decide(f, Context(now_s=NOW, spare_nodes=2, dp_size=4))
    assert [(a.kind, a.target) for a in decision.actions if a.kind is A.MIGRATE] == [
        (A.MIGRATE, "node-1"),
        (A.MIGRATE, "node-2"),
    ]
    assert [a.target for a in decision.actions if a.kind is A.CORDON] == ["node-1", "node-2"]
    decision = decide(f, Context(now_s=NOW, spare_nodes=1, dp_size=4))
    (resize,) = [a for a in decision.actions if a.kind is A.RESIZE]
    assert resize.target == "node-1,node-2" and "4 -> 2" in resize.reason


def test_restart_budget_per_hour_blocks_disruptive_steps_only() -> None:
    budget = Budget(max_restarts_per_hour=2, cooldown_s=0)
    ctx = Context(now_s=NOW, restart_times_s=(NOW - 3000, NOW - 100), spare_nodes=1)
    decision = decide(finding(FindingKind.HANG), ctx, budget)
    assert [a.kind for a in decision.actions] == [S]
    assert "2 restarts in the last hour" in decision.suppressed
    # An hour later the old restart no longer counts.
    later = Context(now_s=NOW + 700, restart_times_s=ctx.restart_times_s, spare_nodes=1)
    assert decide(finding(FindingKind.HANG), later, budget).restarts


def test_cooldown_blocks_a_restart_right_after_another() -> None:
    ctx = Context(now_s=NOW, restart_times_s=(NOW - 10,))
    decision = decide(
        finding(FindingKind.CRASH),
        Context(now_s=NOW, restart_times_s=(NOW - 10,), job_down=True),
        Budget(cooldown_s=60),
    )
    assert decision.actions == () and decision.give_up
    assert "cooling down" in decision.suppressed
    assert not decide(finding(FindingKind.HANG), ctx, Budget(cooldown_s=60)).restarts
    assert decide(finding(FindingKind.HANG), ctx, Budget(cooldown_s=5)).restarts


def test_low_confidence_is_recorded_not_acted_on_unless_the_job_is_down() -> None:
    weak = finding(FindingKind.STRAGGLER, slowdown=2.0, confidence=0.3)
    decision = decide(weak, Context(now_s=NOW, spare_nodes=1))
    assert [a.kind for a in decision.actions] == [C, D]
    assert "confidence 0.30" in decision.suppressed
    crash = finding(FindingKind.CRASH, confidence=0.3)
    assert decide(crash, Context(now_s=NOW, job_down=True)).restarts


def test_repeat_offender_node_is_moved_away_from() -> None:
    crash = finding(FindingKind.CRASH, nodes=("node-3",))
    first = decide(crash, Context(now_s=NOW, spare_nodes=1, job_down=True))
    assert [a.kind for a in first.actions] == [R]
    again = decide(
        crash, Context(now_s=NOW, spare_nodes=1, job_down=True, culprit_counts={"node-3": 1})
    )
    assert [(a.kind, a.target) for a in again.actions] == [(M, "node-3")]


def test_no_checkpoint_is_requested_from_a_dead_job() -> None:
    decision = decide(
        finding(FindingKind.NODE_FAULT), Context(now_s=NOW, spare_nodes=1, job_down=True)
    )
    assert [a.kind for a in decision.actions] == [K, M]


def test_flapping_node_cannot_loop_restarts() -> None:
    """A node crashing every 2 minutes gets at most max_restarts_per_hour restarts an hour."""
    budget = Budget(max_restarts_per_hour=4, cooldown_s=60)
    restarts: list[float] = []
    for minute in range(0, 60, 2):
        now = NOW + minute * 60
        d = decide(
            finding(FindingKind.CRASH),
            Context(now_s=now, restart_times_s=tuple(restarts), job_down=True),
            budget,
        )
        if d.restarts:
            restarts.append(now)
    assert len(restarts) == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_restarts_per_hour": -1}, "max_restarts_per_hour"),
        ({"cooldown_s": float("nan")}, "cooldown_s"),
        ({"min_confidence": 1.5}, "min_confidence"),
        ({"relocate_after_repeats": 0}, "relocate_after_repeats"),
    ],
)
def test_bad_budget_is_refused(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Budget(**kwargs)  # type: ignore[arg-type]


def test_culprit_counts() -> None:
    fs = [finding(FindingKind.CRASH, nodes=n) for n in (("a",), ("a", "b"), ("a", "a"))]
    assert policy.culprit_nodes(fs) == {"a": 3, "b": 1}


def test_decide_is_total_over_kinds_severities_and_contexts() -> None:
    """No combination raises, and a down job either restarts or gives up."""
    for kind, slow, spare, dp, down in itertools.product(
        FindingKind, (None, 1.0, 1.25, 1.7), (0, 1), (1, 2, 8), (False, True)
    ):
        d = decide(
            finding(kind, slowdown=slow),
            Context(now_s=NOW, spare_nodes=spare, dp_size=dp, job_down=down),
        )
        if down:
            assert d.restarts != d.give_up
