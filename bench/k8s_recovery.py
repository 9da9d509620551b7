"""Recovery on Kubernetes: a straggler in a 64-pod JobSet, and controllers killed mid-recovery.

Runs on kmock's Kubernetes emulator with the fake JobSet controller of tests/recovery/k8s (it
fails the Job on the evicted pod and recreates every pod as the next generation, placing them
the way the scheduler would). Two parts:

  1. `--runs` recoveries of a straggler on one node of a 64-pod JobSet (66 nodes: 2 spares), by
     the controller with `k8s_executor.KubernetesExecutor` in this process: the API calls vigil
     made from the finding to the new generation running (journal writes included), the time
     from the finding to the Eviction request (the checkpoint's wait excluded: it is printed on
     its own line), and the controller's share of the time to recover (finding -> eviction,
     over finding -> every pod of the new generation created; the rest is the JobSet
     controller's recreation).
  2. `--killed` runs of `vigil controller --kubernetes` (the real CLI, a subprocess) on an 8-pod
     JobSet, killed at each stage of the recovery in turn (planned, stopped, placed, launched,
     recorded) and started again: exactly once = one quarantine, one eviction, one JobSet restart
     and no pod back on the bad node.

Medians with min-max spread. The last line is one JSON object with `api_calls_per_recovery`,
`finding_to_evict_s`, `exactly_once_runs` and `exactly_once_failures` (targets: <= 2 s and 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.recovery.k8s import killed  # noqa: E402
from tests.recovery.k8s.cluster import running  # noqa: E402
from tests.recovery.k8s.test_recovery import (  # noqa: E402
    NS,
    Once,
    SdkCheckpoint,
    executor,
    straggler,
)
from vigil.recovery import controller, k8s_journal, k8s_resize  # noqa: E402

PODS = 64


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def one_recovery() -> dict[str, float]:
    with (
        running(NS, nodes=PODS + 2, replicas=PODS) as (cluster, fake),
        tempfile.TemporaryDirectory() as scratch,
    ):
        fake.finish_generation = 1
        # The executor's default wait interval; 64 pods recreated by the fake take a while on
        # a loaded machine, which the 20 s of the tests' executor does not allow.
        ex = executor(cluster, poll_s=0.5, restart_timeout_s=180.0)
        book = k8s_journal.AnnotationJournal(ex.store, Path(scratch))
        layout = ex.placement()
        findings = Once([straggler("node-7")])
        checkpoint = SdkCheckpoint(cluster)
        ctl = controller.Controller(
            config=controller.ControllerConfig(
                job_id="train",
                run_id="bench",
                poll_interval_s=0.05,
                min_dp_size=k8s_resize.policy_floor(ex.read_jobset(), pods=len(layout.active)),
                diagnose_timeout_s=30.0,
            ),
            executor=ex,
            journal=book,
            placement=layout,
            findings=findings,
            checkpointer=checkpoint,
        )
        before = len(cluster.vigil_calls())
        ctl._start_or_resume()
        start_calls = len(cluster.vigil_calls())
        found_s = time.time()
        ctl._step()  # fetches the finding and carries out the whole recovery
        recovered_calls = len(cluster.vigil_calls())
        while ctl.state.finished is False:
            ctl._step()
            time.sleep(0.05)
        migrate = book.get("straggler-node-7/2-migrate")
        ckpt = book.get("straggler-node-7/0-checkpoint")
        assert migrate is not None and migrate.attempt == 1, migrate
        assert ckpt is not None
        (evicted_s,) = cluster.evicted_s
        to_evict = next(
            i for i, c in enumerate(cluster.vigil_calls()) if c.subresource == "eviction"
        )
        checkpoint_s = ckpt.end_s - ckpt.start_s
        recreated_s = fake.recreated_s[1]
        return {
            "setup_calls": start_calls - before,
            "api_calls": recovered_calls - start_calls,
            "api_calls_to_evict": to_evict + 1 - start_calls,
            "finding_to_evict_s": evicted_s - found_s - checkpoint_s,
            "checkpoint_s": checkpoint_s,
            "time_to_recover_s": recreated_s - found_s,
            "controller_share": (evicted_s - found_s) / (recreated_s - found_s),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="recoveries of the 64-pod JobSet")
    parser.add_argument("--killed", type=int, default=20, help="killed-controller runs (>= 20)")
    args = parser.parse_args()

    runs = [one_recovery() for _ in range(args.runs)]
    for key in (
        "api_calls",
        "api_calls_to_evict",
        "finding_to_evict_s",
        "checkpoint_s",
        "time_to_recover_s",
    ):
        print(f"{PODS}-pod JobSet, {key}: {_spread([r[key] for r in runs])}")
    print(
        f"controller share of time to recover (finding -> eviction over finding -> pods "
        f"recreated): {_spread([r['controller_share'] for r in runs])}"
    )

    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.killed):
            stage = killed.STAGES[i % len(killed.STAGES)]
            outcome = killed.killed_run(stage, NS, Path(tmp), replicas=8, spares=1)
            outcomes.append(outcome)
            print(
                f"killed at {stage:<9} exactly once: {outcome.exactly_once} "
                f"(restarts {outcome.restarts}, evictions {outcome.evictions}, quarantines "
                f"{outcome.quarantines}, pods back on the bad node {outcome.pods_on_bad_node}; "
                f"exits {outcome.first_exit}/{outcome.second_exit}; second run "
                f"{outcome.second_run_s:.1f} s)"
            )
    failures = sum(1 for o in outcomes if not o.exactly_once)
    print(
        json.dumps(
            {
                "api_calls_per_recovery": statistics.median(r["api_calls"] for r in runs),
                "finding_to_evict_s": round(
                    statistics.median(r["finding_to_evict_s"] for r in runs), 3
                ),
                "checkpoint_s": round(statistics.median(r["checkpoint_s"] for r in runs), 3),
                "controller_share_of_recovery": round(
                    statistics.median(r["controller_share"] for r in runs), 3
                ),
                "pods": PODS,
                "exactly_once_runs": len(outcomes),
                "exactly_once_failures": failures,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
