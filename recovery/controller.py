"""The recovery controller: watches a job, turns findings into actions, and carries them out.

It owns the loop only: detection comes from the executor (ranks that died) and from a
`FindingSource` (the analyzer's findings, e.g. through the collector); what to do comes from the
pure `policy`; how to do it from an `Executor` (the protocol alone: the controller reaches ranks
and nodes through nothing else); and every step is journaled first (`journal`) so a controller
killed at any point and started again finishes each recovery exactly once.

The record it keeps (through its `ActionSink`): a crash finding per failed attempt (the rank,
its exit code or signal, the step it died in), every action's states, a diagnosed node's
results, and for each restart the attempt it launched, then (same action id, once a `StepWatch`
sees the new attempt's first step) the resume step, the steps lost and when it recovered.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from vigil.analyzer import stacks as analyzer_stacks
from vigil.env import EnvVar
from vigil.recovery import attempts, diagnosis, policy
from vigil.recovery import journal as journal_mod
from vigil.recovery.attempts import crash_finding_id
from vigil.recovery.executor import Executor, RankExit
from vigil.recovery.placement import Placement
from vigil.recovery.ports import (
    ActionSink,
    Checkpointer,
    CheckpointOutcome,
    FindingSource,
    StepWatch,
)
from vigil.schema import (
    Action,
    ActionKind,
    ActionState,
    DiagResult,
    Finding,
    FindingKind,
    FindingState,
    Verdict,
)

log = logging.getLogger(__name__)
__all__ = [
    "ActionSink",
    "CheckpointOutcome",
    "Checkpointer",
    "Controller",
    "ControllerConfig",
    "FindingSource",
    "StepWatch",
    "crash_finding_id",
]

# `vigil train` (and well-behaved jobs) exit 2 on a bad configuration: never restart for that.
BAD_CONFIG_EXIT = 2
# Test-only crash injection: the controller exits hard when it reaches this stage (see STAGES).
STAGES = ("planned", "stopped", "placed", "launched", "recorded")


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    job_id: str
    run_id: str
    # The local supervisor's own restart budget, like torchrun's --max-restarts.
    max_restarts: int = 3
    # 0.2 s polling notices a dead rank well inside one step of any real job.
    poll_interval_s: float = 0.2
    # Ranks get 10 s to exit on SIGTERM (enough to flush logs), then SIGKILL.
    stop_timeout_s: float = 10.0
    # A checkpoint request waits at most this long for a commit before recovery goes ahead.
    checkpoint_timeout_s: float = 60.0
    min_dp_size: int = 1
    # A hang finding must stay open this long before the job is restarted for it: a rank that
    # was only slow resumes and the analyzer resolves the finding in the meantime.
    hang_confirm_s: float = 2.0
    # A diagnosed node's quick suite: seconds on a CPU, about a minute on a GPU node.
    diagnose_timeout_s: float = 300.0
    # How often the sink's spooled posts are sent again between posts.
    replay_interval_s: float = 5.0
    budget: policy.Budget = field(default_factory=policy.Budget)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.poll_interval_s <= 0 or self.stop_timeout_s < 0 or self.checkpoint_timeout_s < 0:
            raise ValueError("poll_interval_s must be > 0 and timeouts >= 0")


@dataclass(kw_only=True)
class Controller:
    config: ControllerConfig
    executor: Executor
    journal: journal_mod.Journal
    placement: Placement
    findings: FindingSource | None = None
    checkpointer: Checkpointer | None = None
    sink: ActionSink | None = None
    steps: StepWatch | None = None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    state: journal_mod.ControllerState = field(init=False)
    # Ranks of the current attempt taken over from a previous controller at resume.
    _adopted: int = field(default=0, init=False)
    # When each open finding was first seen, for the hang confirmation delay.
    _first_seen: dict[str, float] = field(default_factory=dict, init=False)
    # Ranks of the running attempt that exited cleanly (one that left its loop early is the
    # culprit of the crash its peers then end in); in memory only.
    _left: list[RankExit] = field(default_factory=list, init=False)
    _replayed_s: float = field(default=0.0, init=False)
    _diagnoses: diagnosis.Diagnoses = field(init=False)

    def __post_init__(self) -> None:
        self._diagnoses = diagnosis.Diagnoses(self.executor, self.config.diagnose_timeout_s)

    def run(self) -> int:
        """Supervise the job to its end; returns 0 when every rank finished cleanly."""
        self._start_or_resume()
        while not self.state.finished:
            self._step()
            if not self.state.finished:
                self.sleep(self.config.poll_interval_s)
        # A diagnosis still running when the job ended is waited for: its verdict is the record.
        self._record_diagnoses(self._diagnoses.wait(self.config.diagnose_timeout_s))
        return self.state.exit_code

    # -- start and resume -------------------------------------------------------------------

    def _start_or_resume(self) -> None:
        saved = self.journal.load_state()
        if saved is None:
            self.state = journal_mod.ControllerState(run_id=self.config.run_id)
            self._launch(0)
            return
        self.state = saved
        self.placement = self._placement_from_state()
        if saved.finished:
            return
        log.info("resuming run %s at attempt %d", saved.run_id, saved.attempt)
        self._adopted = self.executor.adopt(self.placement, saved.attempt)
        for action in self.journal.actions():  # diagnoses a previous controller left running
            if (
                action.kind is ActionKind.DIAGNOSE
                and action.state not in journal_mod.FINAL_STATES
                and action.finding_id != saved.recovering
            ):
                self._execute(action)
        if saved.recovering:
            self._finish_recovery(saved.recovering)
        elif self._adopted < self.placement.world_size:
            self.executor.kill_attempt(saved.attempt)
            self._launch(saved.attempt)

    def _placement_from_state(self) -> Placement:
        return Placement(
            active=tuple(self.state.active),
            spares=tuple(self.state.spares),
            ranks_per_node=self.state.ranks_per_node,
            cordoned=frozenset(self.state.cordoned),
        )

    def _save_placement(self, placement: Placement) -> None:
        self.placement = placement
        self.state.active = list(placement.active)
        self.state.spares = list(placement.spares)
        self.state.cordoned = sorted(placement.cordoned)
        self.state.ranks_per_node = placement.ranks_per_node
        self.journal.save_state(self.state)

    # -- the loop -----------------------------------------------------------------------------

    def _step(self) -> None:
        self._replay_sink()
        self._record_diagnoses(self._diagnoses.finished())
        exits = self.executor.poll()
        failed = [e for e in exits if e.returncode != 0]
        self._left.extend(e for e in exits if e.returncode == 0)
        if any(e.returncode == BAD_CONFIG_EXIT for e in failed):
            self._finish(
                BAD_CONFIG_EXIT, "the job rejected its configuration; a restart won't fix it"
            )
            return
        if failed:
            # Read before anything is stopped: the ranks' pages say where each one got to.
            last = self._last_steps()
            finding = attempts.crash_finding(
                self.config.job_id, self.state.attempt, failed, last, now_s=self.clock(),
                left=self._left,
            )  # fmt: skip
            self._publish(finding)
            self._handle(finding, job_down=True, last=last)
            return
        self._watch_first_step()
        if exits and not self.executor.alive():
            self._finish(0, "every rank finished")
            return
        for finding in self.findings.fetch() if self.findings else ():
            if self._actionable(finding):
                self._handle(finding, job_down=False)
                if self.state.finished:
                    return

    def _actionable(self, finding: Finding) -> bool:
        """Open, about this job, not handled yet, about the running attempt, and confirmed."""
        if finding.job_id != self.config.job_id or finding.state is not FindingState.OPEN:
            return False
        if finding.kind is FindingKind.CRASH:
            return False  # the executor sees dead ranks itself, first and for certain
        if finding.kind is FindingKind.RECOVERY_UNSAFE:
            return False  # the job's own configuration: nothing to do but report it
        if finding.finding_id in self._handled():
            return False
        # Evidence gathered before this attempt started describes ranks that are gone (e.g. the
        # silence of our own restart): it is stale.
        window_start = finding.trace_start_s or finding.detected_s
        if window_start < self.state.attempt_started_s:
            return False
        now = self.clock()
        first = self._first_seen.setdefault(finding.finding_id, now)
        return finding.kind is not FindingKind.HANG or now - first >= self.config.hang_confirm_s

    def _handled(self) -> set[str]:
        return set(self.state.handled_findings)

    def _last_steps(self) -> dict[int, int] | None:
        """Each rank's newest finished step in the running attempt (None: no watch or it failed)."""
        if self.steps is None:
            return None
        try:
            return self.steps.last_steps(self.state.attempt, self.state.attempt_started_s)
        except Exception as exc:  # the record is best effort; recovery goes on without it
            log.warning("could not read where the ranks got to: %s", exc)
            return None

    def _watch_first_step(self) -> None:
        """Once the awaited restart's attempt has finished a step, post that restart again with
        its resume step, steps lost and recovery time."""
        action = self.journal.get(self.state.awaiting_first_step or "")
        if action is None or self.steps is None:
            return
        try:
            first = self.steps.first_step(self.state.attempt, self.state.attempt_started_s)
        except Exception as exc:
            log.warning("could not read the new attempt's first step: %s", exc)
            return
        if first is None:
            return
        lost = attempts.steps_lost(self.state.failed_last_step, first.step)
        self.state.awaiting_first_step = ""
        self.journal.save_state(self.state)
        self.steps.forget()
        self._record(
            msgspec.structs.replace(
                action, resume_step=first.step, steps_lost=lost, recovered_s=first.seen_s
            )
        )
        log.info(
            "attempt %d resumed at step %d (%s lost; from %s)",
            self.state.attempt,
            first.step,
            "?" if lost < 0 else lost,
            first.source,
        )

    def _replay_sink(self) -> None:
        now = self.clock()
        if self.sink is None or now - self._replayed_s < self.config.replay_interval_s:
            return
        self._replayed_s = now
        try:
            self.sink.replay()
        except Exception as exc:  # best effort, as every post
            log.warning("could not send spooled records: %s", exc)

    def _handle(
        self, finding: Finding, *, job_down: bool, last: dict[int, int] | None = None
    ) -> None:
        context = policy.Context(
            now_s=self.clock(),
            restart_times_s=tuple(self.state.restart_times_s),
            spare_nodes=len(self.placement.spares),
            dp_size=len(self.placement.active),
            min_dp_size=self.config.min_dp_size,
            culprit_counts=dict(self.state.culprit_counts),
            job_down=job_down,
        )
        decision = policy.decide(finding, context, self.config.budget)
        if decision.suppressed:
            log.warning("%s: %s", finding.finding_id, decision.suppressed)
        if decision.restarts and len(self.state.restart_times_s) >= self.config.max_restarts:
            decision = policy.Decision(
                actions=tuple(a for a in decision.actions if a.kind not in policy.RESTARTING),
                suppressed=f"max restarts ({self.config.max_restarts}) reached",
                give_up=job_down,
            )
        for i, planned in enumerate(decision.actions):
            action_id = f"{finding.finding_id}/{i}-{planned.kind.value}"
            if self.journal.get(action_id) is None:
                self._record(
                    Action(
                        action_id=action_id,
                        kind=planned.kind,
                        job_id=self.config.job_id,
                        target=planned.target,
                        finding_id=finding.finding_id,
                        result=planned.reason,
                    )
                )
        for node in finding.subjects.nodes:
            self.state.culprit_counts[node] = self.state.culprit_counts.get(node, 0) + 1
        if decision.restarts:
            last = last if last is not None else self._last_steps()
            # A data-parallel step is trained once every replica finished it: the newest step
            # all ranks finished (a rank may log the step that failed under it as finished).
            self.state.failed_last_step = None if last is None else min(last.values(), default=-1)
        self.state.awaiting_first_step = ""  # a new failure: the old attempt's record stays open
        self.state.recovering = finding.finding_id
        self.state.recovering_from = self.state.attempt
        # A dead or hung job cannot stop gracefully (its state is in the snapshots already).
        self.state.recovering_graceful = not job_down and finding.kind is not FindingKind.HANG
        self.journal.save_state(self.state)
        self._die_if("planned")
        self._finish_recovery(finding.finding_id)
        if decision.give_up:
            reason = decision.suppressed or "no restart allowed"
            self._finish(1, f"job down and not restarted: {reason}")

    def _finish_recovery(self, finding_id: str) -> None:
        for action in sorted(
            (a for a in self.journal.actions() if a.finding_id == finding_id),
            key=lambda a: a.action_id,
        ):
            if action.state not in journal_mod.FINAL_STATES:
                self._execute(action)
        self.state.handled_findings.append(finding_id)
        self.state.recovering = ""
        self.journal.save_state(self.state)

    # -- carrying out actions -------------------------------------------------------------------

    def _execute(self, action: Action) -> None:
        start = self.clock()
        self._record(msgspec.structs.replace(action, state=ActionState.RUNNING, start_s=start))
        nodes = self._nodes_of(action.target) if action.kind is ActionKind.DIAGNOSE else []
        if nodes:  # runs in the background; `_record_diagnoses` records how it ended
            self._diagnoses.start(action, nodes, start)
            return
        try:
            state, result = self._carry_out(action)
        except Exception as exc:  # an action that fails is recorded, never crashes the loop
            log.exception("action %s failed", action.action_id)
            state, result = ActionState.FAILED, f"{type(exc).__name__}: {exc}"
        restarted = action.kind in policy.RESTARTING and state is ActionState.SUCCEEDED
        done = msgspec.structs.replace(
            action,
            state=state,
            start_s=start,
            end_s=self.clock(),
            result=result,
            attempt=self.state.attempt if restarted else action.attempt,
        )
        if restarted:
            self.state.awaiting_first_step = action.action_id
            self.journal.save_state(self.state)
        self._record(done)
        self._die_if("recorded")

    def _carry_out(self, action: Action) -> tuple[ActionState, str]:
        if action.kind in policy.RESTARTING:
            return self._restart(action)
        if action.kind is ActionKind.CHECKPOINT:
            if self.checkpointer is None:
                return ActionState.SKIPPED, "no checkpoint channel to this job"
            timeout_s = self.config.checkpoint_timeout_s
            outcome = self.checkpointer.request(timeout_s=timeout_s)
            # Succeeded means committed: a request the job only acknowledged is not a checkpoint.
            state = ActionState.SUCCEEDED if outcome.committed else ActionState.FAILED
            return state, outcome.describe(timeout_s)
        if action.kind is ActionKind.DUMP_STACKS:
            return self._dump_stacks(action)
        if action.kind is ActionKind.DIAGNOSE:
            return ActionState.SKIPPED, f"no node to diagnose in {action.target!r}"
        if action.kind is ActionKind.CORDON:
            self.executor.cordon(action.target)
            return ActionState.SUCCEEDED, f"{action.target} cordoned"
        return ActionState.SKIPPED, f"{action.kind.value} is not available on the executor"

    def _record_diagnoses(self, outcomes: Sequence[diagnosis.Outcome]) -> None:
        """Record finished diagnoses: each result published, each node's verdict in the
        action's result, and a failing node cordoned (no restart places ranks on it again)."""
        for outcome in outcomes:
            parts, failed = [], False
            for node, results in outcome.results.items():
                if isinstance(results, str):
                    parts.append(f"{node}: unknown ({results})")
                    failed = True
                    continue
                for result in results:
                    self._publish(result)
                parts.append(diagnosis.describe(node, results))
                if diagnosis.worst_verdict(results) is Verdict.FAIL:
                    self.executor.cordon(node)
                    self._save_placement(self.placement.cordon(node))
                    parts[-1] += "; cordoned"
            self._record(
                msgspec.structs.replace(
                    outcome.action,
                    state=ActionState.FAILED if failed else ActionState.SUCCEEDED,
                    start_s=outcome.start_s,
                    end_s=self.clock(),
                    result="; ".join(parts),
                )
            )
            self._die_if("recorded")

    def _nodes_of(self, target: str) -> list[str]:
        """Node names in a comma-separated target ("node-1", "rank3")."""
        nodes: list[str] = []
        for part in (p.strip() for p in target.split(",")):
            if part.startswith("rank") and part[4:].isdigit():
                nodes.extend(self.placement.nodes_of([int(part[4:])]))
            elif part in self.placement.active or part in self.placement.spares:
                nodes.append(part)
        return list(dict.fromkeys(nodes))

    def _dump_stacks(self, action: Action) -> tuple[ActionState, str]:
        ranks = self.executor.alive()
        stacks = self.executor.dump_stacks(ranks)
        folder = self.journal.run_dir / "stacks" / action.finding_id.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        for rank, text in stacks.items():
            (folder / f"rank-{rank}.txt").write_text(text)
        groups = analyzer_stacks.group(
            {rank: analyzer_stacks.parse(t) for rank, t in stacks.items()}
        )
        summary = "; ".join(f"ranks {ranks} share one stack" for ranks, _ in groups)
        return ActionState.SUCCEEDED, f"{len(stacks)} stacks in {folder}: {summary}"

    def _restart(self, action: Action) -> tuple[ActionState, str]:
        target = self.state.recovering_from + 1
        if self.state.attempt >= target:
            # A previous controller got as far as placing (and maybe launching) this attempt.
            if self._adopted >= self.placement.world_size:
                return ActionState.SUCCEEDED, f"attempt {target} was already running; adopted it"
            self.executor.stop(timeout_s=self.config.stop_timeout_s)
            self.executor.kill_attempt(target)
        else:
            graceful = self.state.recovering_graceful
            if graceful:  # a healthy job trained on while the recovery began: where is it now?
                last = self._last_steps()
                if last:
                    self.state.failed_last_step = min(last.values())
            # Fence off the nodes a move leaves before the ranks stop: a scheduler (Kubernetes)
            # places the restarted ranks the moment the old ones go (idempotent per node).
            if action.kind is not ActionKind.RESTART:
                for node in (n for n in action.target.split(",") if n):
                    self.executor.cordon(node)
            self.executor.stop(timeout_s=self.config.stop_timeout_s if graceful else 0.0)
            self.executor.kill_attempt(self.state.attempt)
            self._die_if("stopped")
            nodes = [n for n in action.target.split(",") if n]
            placement = self.placement
            if action.kind is ActionKind.MIGRATE:
                placement = placement.migrate(nodes)
            elif action.kind is ActionKind.RESIZE:
                placement = placement.resize(nodes)
            # Never back onto a node a diagnosis cordoned: move off it (spare) or drop it.
            avoided = placement.avoid_cordoned()
            moved = [n for n in placement.active if n not in avoided.active]
            placement = avoided
            for node in [*(nodes if action.kind is not ActionKind.RESTART else ()), *moved]:
                self.executor.forget_node(node, self.config.job_id)
            self.state.attempt = target
            self.state.restart_times_s.append(self.clock())
            self._save_placement(placement)
            self._die_if("placed")
        self._launch(target)
        self._die_if("launched")
        return ActionState.SUCCEEDED, (
            f"attempt {target} on {','.join(self.placement.active)} "
            f"(world size {self.placement.world_size})"
        )

    def _launch(self, attempt: int) -> None:
        self.state.attempt_started_s = self.clock()
        self._left = []
        self._save_placement(self.placement)
        self.executor.launch(self.placement, attempt)

    def _record(self, action: Action) -> None:
        self.journal.record(action)
        self._publish(action)

    def _publish(self, record: Action | Finding | DiagResult) -> None:
        if self.sink is not None:
            try:
                self.sink.publish(record)
            except Exception as exc:  # the journal is the truth; the sink is best effort
                log.warning("could not publish %s: %s", type(record).__name__, exc)

    def _finish(self, code: int, why: str) -> None:
        log.info("job %s finished (exit %d): %s", self.config.job_id, code, why)
        self.executor.stop(timeout_s=self.config.stop_timeout_s)
        self.state.finished = True
        self.state.exit_code = code
        self.journal.save_state(self.state)

    def _die_if(self, stage: str) -> None:
        if os.environ.get(EnvVar.CONTROLLER_DIE_AT) == stage:
            log.error("dying at stage %r (%s is set)", stage, EnvVar.CONTROLLER_DIE_AT)
            os._exit(70)
