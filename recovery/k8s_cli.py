"""`vigil controller --kubernetes`: the recovery controller for one JobSet or TrainJob.

Argument parsing and wiring only: the loop is `controller.Controller`, the cluster work
`k8s_executor.KubernetesExecutor` (imported when the command runs, so `vigil --help` never needs
the Kubernetes client), the journal `k8s_journal.AnnotationJournal` on the JobSet itself, and,
with a collector, checkpoint now / dump stacks through `collector_link.CollectorControl`.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
import uuid

from vigil import cli, settings
from vigil.recovery import collector_link, controller, journal, k8s_journal, k8s_plan, k8s_resize

log = logging.getLogger(__name__)

# Exit code when another controller holds the Lease and --wait-lease is 0.
LEASE_HELD_EXIT = 3


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubernetes",
        action="store_true",
        required=True,
        help="recover a job on Kubernetes (the only executor this command runs)",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--jobset", help="the JobSet to recover")
    target.add_argument("--trainjob", help="the Kubeflow TrainJob to recover (through its JobSet)")
    parser.add_argument("--namespace", required=True, help="the job's namespace")
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default: the pod's service account, else ~/.kube/config)",
    )
    parser.add_argument("--context", default=None, help="kubeconfig context")
    parser.add_argument(
        "--mode",
        choices=("observe", "advise", "act"),
        default="observe",
        help="observe (default): record what it would do, change nothing; advise: propose each "
        "change through the collector and make it once a person approved it "
        "(POST /api/v1/actions/<id>/approve); act: quarantine, "
        "evict and restart (only in --allow-namespace namespaces)",
    )
    parser.add_argument(
        "--allow-namespace",
        action="append",
        default=[],
        help="a namespace `act` may change (repeat; default none: everything is observed)",
    )
    parser.add_argument(
        "--breaker-max-nodes",
        type=cli.non_negative_int,
        default=2,
        help="nodes vigil may quarantine per window (default 2)",
    )
    parser.add_argument(
        "--breaker-max-fraction",
        type=float,
        default=0.1,
        help="share of the cluster's nodes vigil may quarantine per window (default 0.1)",
    )
    parser.add_argument(
        "--breaker-window",
        type=cli.non_negative_float,
        default=3600.0,
        help="the circuit breaker's window in seconds (default 3600)",
    )
    parser.add_argument(
        "--ranks-per-pod", type=cli.positive_int, default=1, help="ranks each pod runs (nproc)"
    )
    parser.add_argument(
        "--max-restarts", type=cli.non_negative_int, default=3, help="restarts before giving up"
    )
    parser.add_argument(
        "--job", default=None, help="the job id the ranks report under (default: the job's name)"
    )
    parser.add_argument(
        "--collector",
        type=cli.collector_url,
        default=None,
        help="collector URL: findings come from there and actions go there",
    )
    parser.add_argument(
        "--lease-namespace",
        default=None,
        help="namespace of the one-active-controller Lease (default: the job's)",
    )
    parser.add_argument(
        "--lease-name",
        default=None,
        help="the Lease name (default vigil-controller-<job>: one active controller per job)",
    )
    parser.add_argument(
        "--lease-identity",
        default=socket.gethostname(),
        help="who holds the Lease (default: the host name, i.e. the pod's name, so a restarted "
        "container takes its own Lease back at once; a replacement pod waits for it to expire)",
    )
    parser.add_argument(
        "--lease-duration",
        type=cli.positive_int,
        default=15,
        help="seconds the Lease lasts unless renewed (default 15)",
    )
    parser.add_argument(
        "--wait-lease",
        type=cli.non_negative_float,
        default=60.0,
        help="seconds to wait for the Lease another controller holds (default 60)",
    )
    parser.add_argument(
        "--approval-timeout",
        type=cli.non_negative_float,
        default=600.0,
        help="advise mode: seconds a proposed change waits for approval (default 600)",
    )
    parser.add_argument(
        "--api-timeout",
        type=cli.positive_float,
        default=10.0,
        help="seconds one Kubernetes API request may take (default 10; keep it below "
        "--lease-duration): a poll past it is skipped and retried at the next tick",
    )
    parser.add_argument(
        "--poll-interval",
        type=cli.non_negative_float,
        default=1.0,
        help="seconds between looks at the job (default 1)",
    )


def _run(args: argparse.Namespace) -> int:
    try:
        from vigil.recovery import k8s_executor
        from vigil.recovery import kubernetes as kube
    except ImportError as exc:
        sys.stderr.write(
            f"vigil controller: the Kubernetes client is missing ({exc}); install vigil[k8s]\n"
        )
        return 2
    name = args.jobset or args.trainjob
    common = settings.CommonSettings()
    url = args.collector or common.collector_url or None
    if args.mode == "advise" and not url:
        sys.stderr.write("vigil controller: advise mode needs a collector (--collector URL)\n")
        return 2
    try:
        breaker = k8s_plan.BreakerLimits(
            max_nodes=args.breaker_max_nodes,
            max_fraction=args.breaker_max_fraction,
            window_s=args.breaker_window,
        )
    except ValueError as exc:
        sys.stderr.write(f"vigil controller: circuit breaker: {exc}\n")
        return 2
    try:
        api = kube.Api(
            kube.connect(args.kubeconfig, args.context), request_timeout_s=args.api_timeout
        )
    except Exception as exc:  # a bad kubeconfig raises the client's own ConfigException
        sys.stderr.write(f"vigil controller: cannot reach the cluster: {exc}\n")
        return 2
    kind = kube.TRAINJOB if args.trainjob else kube.JOBSET
    # Observe mode changes nothing, its journal included: it stays in memory until the executor
    # (mode, allow-list, the job's preconditions) says this controller acts.
    store: k8s_journal.AnnotationStore = k8s_journal.MemoryStore()
    executor = k8s_executor.KubernetesExecutor(
        api=api,
        namespace=args.namespace,
        jobset=name,
        trainjob=args.trainjob or "",
        mode=args.mode,
        allowed_namespaces=frozenset(args.allow_namespace),
        breaker=breaker,
        store=store,
        ranks_per_pod=args.ranks_per_pod,
    )
    acting = executor.acting
    if acting:
        store = executor.store = kube.JobSetAnnotations(api, args.namespace, name, kind)
        lease = kube.Lease(
            api=api,
            namespace=args.lease_namespace or args.namespace,
            name=args.lease_name or f"vigil-controller-{name}",
            identity=args.lease_identity,
            duration_s=args.lease_duration,
        )
        deadline = time.monotonic() + args.wait_lease
        while not lease.acquire():
            if time.monotonic() > deadline:
                sys.stderr.write(
                    f"vigil controller: another controller holds Lease "
                    f"{lease.namespace}/{lease.name}\n"
                )
                return LEASE_HELD_EXIT
            time.sleep(1.0)
        executor.lease = lease
    job_id = args.job or name
    sinks: list[collector_link.CollectorActions] = (
        [collector_link.CollectorActions(url=url, token=common.token)] if url else []
    )
    sink = journal.Tee(sinks)
    # Checkpoint now and dump stacks go through the collector to the ranks' node agents. Only an
    # acting controller asks for a checkpoint (observe mode changes nothing in the job).
    control = (
        collector_link.CollectorControl(url=url, job_id=job_id, token=common.token) if url else None
    )
    executor.control = control
    if url and args.mode == "advise":
        executor.job_id = job_id
        executor.approval_timeout_s = args.approval_timeout
        executor.approvals = collector_link.CollectorApprovals(
            url=url, actions=sinks[0], token=common.token
        )
    for problem in executor.problems:
        sys.stderr.write(f"vigil controller: {args.namespace}/{name}: {problem}\n")
    if executor.gaps:
        # Reported as a finding (each missing precondition its evidence); nothing is acted on.
        sink.publish(
            k8s_plan.unsafe_finding(
                job_id,
                f"{'TrainJob' if args.trainjob else 'JobSet'} {args.namespace}/{name}",
                executor.gaps,
                nodes=[s.node for s in executor.slots() if s.node],
                now_s=time.time(),
            )
        )
    book = k8s_journal.AnnotationJournal(store)
    layout = executor.placement()
    saved = book.load_state()
    config = controller.ControllerConfig(
        job_id=job_id,
        run_id=saved.run_id if saved else uuid.uuid4().hex,
        max_restarts=args.max_restarts,
        poll_interval_s=max(args.poll_interval, 0.05),
        # Without a spare a relocation is planned as a resize: the executor shrinks the JobSet
        # where its elastic range and shape allow, otherwise the job stays (quarantined node).
        min_dp_size=k8s_resize.policy_floor(executor.read_jobset(), pods=len(layout.active)),
        stop_timeout_s=0.0,
    )
    sys.stderr.write(
        f"vigil controller: {args.namespace}/{name} in {args.mode} mode"
        + ("" if acting or args.mode == "observe" else " (not acting here: observing)")
        + f"; {len(layout.active)} pods on {','.join(layout.active)}; "
        f"{len(layout.spares)} spare node(s)\n"
    )
    ctl = controller.Controller(
        config=config,
        executor=executor,
        journal=book,
        placement=layout,
        sink=sink,
        checkpointer=control if acting else None,
        findings=collector_link.CollectorFindings(url=url, job_id=job_id, token=common.token)
        if url
        else None,
    )
    try:
        code = ctl.run()
    except kube.LeaseLostError as exc:
        sys.stderr.write(f"vigil controller: {exc}; stopping\n")
        return LEASE_HELD_EXIT
    finally:
        for s in sinks:
            s.replay()
            s.close()
    for action in book.actions():
        log.info("%s %s %s: %s", action.action_id, action.kind, action.state, action.result)
    return code


controller_command = cli.Command(
    name="controller",
    help="recover a JobSet or TrainJob on Kubernetes (quarantine, evict, restart)",
    configure=_configure,
    run=_run,
)

__all__ = ["controller_command"]
