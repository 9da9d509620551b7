"""The controller's link to the collector: findings in, actions out (HTTP, vigil's wire codec).

`CollectorFindings` polls the analyzer's findings for one job; `CollectorSteps` finds a new
attempt's first step among the job's step records there; `CollectorActions` posts each
action's new state (a restart twice: at relaunch, then with its resume step, steps lost and
recovery time), the controller's own crash findings and a diagnosed node's results through
ingest, where the collector upserts actions and findings by id, with the core sender
(`vigil.outbox`): retried with its backoff schedule, spooled while the collector is away, and
sent again, oldest first, before the next post and whenever the controller's loop calls
`replay()` (every few seconds), and the spools of controllers that exited, found beside this
one's, once this one gets through. Both are
best effort: a collector that is down costs visibility, never the recovery (the journal is the
truth), and no post blocks the controller longer than `attempts` x `timeout_s`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from vigil import api, codec, outbox, sender, settings, spool
from vigil.recovery import ports
from vigil.recovery.attempts import FirstStep
from vigil.schema import Action, ActionState, DiagResult, Finding

log = logging.getLogger(__name__)

# 5 s: a poll that takes longer than this is a collector in trouble; the next poll tries again.
DEFAULT_TIMEOUT_S = 5.0


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass(kw_only=True)
class CollectorFindings:
    url: str
    job_id: str
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    client: httpx.Client = field(default_factory=httpx.Client)

    def fetch(self) -> Sequence[Finding]:
        path = f"{self.url.rstrip('/')}{api.API_PREFIX}/jobs/{self.job_id}/findings"
        try:
            response = self.client.get(path, headers=_headers(self.token), timeout=self.timeout_s)
            response.raise_for_status()
            rows: list[dict[str, Any]] = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not fetch findings from %s: %s", path, exc)
            return []
        findings = []
        for row in rows:
            try:
                clean = {k: v for k, v in row.items() if v is not None}
                findings.append(msgspec.convert(clean, Finding))
            except msgspec.ValidationError as exc:
                log.warning("skipping a finding the collector sent: %s", exc)
        return findings


def batch_id(record: Action | Finding | DiagResult) -> str:
    """The batch id of one post: the same record posted twice is stored once, while each new
    state of an action (and a restart's recovery record, posted later) is a batch of its own."""
    if isinstance(record, Action):
        recovered = f"-resumed{record.resume_step}" if record.resume_step >= 0 else ""
        return f"action-{record.action_id}-{record.state.value}{recovered}"
    if isinstance(record, Finding):
        return f"finding-{record.finding_id}"
    digest = hashlib.sha1(codec.encode_json(record), usedforsecurity=False).hexdigest()[:16]
    return f"diag-{record.node}-{digest}"


@dataclass(kw_only=True)
class CollectorSteps:
    """A new attempt's first step from the job's step records in the collector (a step trained
    again replaces its earlier record there, so the attempt's are those started after it)."""

    url: str
    job_id: str
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    client: httpx.Client = field(default_factory=httpx.Client)

    def __call__(self, since_s: float) -> FirstStep | None:
        # The job's last 100 reported steps (the API's default window) hold a fresh attempt's.
        path = f"{self.url.rstrip('/')}{api.API_PREFIX}/jobs/{self.job_id}/steps"
        try:
            response = self.client.get(path, headers=_headers(self.token), timeout=self.timeout_s)
            if response.status_code == 404:
                return None
            response.raise_for_status()
            rows: list[dict[str, Any]] = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not fetch steps from %s: %s", path, exc)
            return None
        mine = [
            r
            for r in rows
            if isinstance(r.get("start_s"), float | int)
            and r["start_s"] >= since_s
            and isinstance(r.get("end_s"), float | int)
        ]
        if not mine:
            return None
        low = min(int(r["step"]) for r in mine)
        seen = min(float(r["end_s"]) for r in mine if int(r["step"]) == low)
        return FirstStep(low, seen, "collector")


# A controller posts a handful of records per recovery: 4 MiB keeps thousands of them.
SPOOL_MAX_BYTES = 4 * 1024 * 1024


@dataclass(kw_only=True)
class CollectorActions:
    url: str
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    client: httpx.Client = field(default_factory=httpx.Client)
    # Where posts wait while the collector is away; None: `<data dir>/spool/controller`.
    spool_dir: Path | None = None
    # Two attempts (a 5xx hiccup is retried once): a wedged collector holds the controller's
    # loop up for at most 2 x timeout_s per post; the spool keeps the rest.
    attempts: int = 2
    sleep: Callable[[float], None] = time.sleep
    _box: outbox.Outbox | None = field(default=None, init=False, repr=False)
    _earlier: outbox.Orphans | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.timeout_s <= 0:
            raise ValueError("CollectorActions needs attempts >= 1 and timeout_s > 0")

    def publish(self, record: Action | Finding | DiagResult) -> None:
        """Post `record` after whatever is spooled; keep it in the spool if it does not go."""
        box, earlier = self._open()
        posted = box.post([record], batch_id=batch_id(record))
        if posted.fate is not outbox.Fate.SPOOLED:  # the collector is there: exited ones' too
            earlier.tick()

    def replay(self) -> bool:
        """Send what is spooled; False while the collector is away."""
        box, earlier = self._open()
        return box.replay() and earlier.tick()

    def _open(self) -> tuple[outbox.Outbox, outbox.Orphans]:
        if self._box is None or self._earlier is None:
            directory = (
                self.spool_dir or settings.CommonSettings().data_dir / "spool" / "controller"
            )
            cfg = sender.SenderConfig(
                collector_url=self.url,
                spool_dir=directory,
                token=self.token,
                spool_max_bytes=SPOOL_MAX_BYTES,
                timeout_s=self.timeout_s,
                max_attempts=self.attempts,
            )
            self._box = outbox.Outbox(
                cfg,
                source="controller",
                client=self.client,
                sleep=self.sleep,
                retried="at the controller's next post or replay (every few seconds)",
            )
            self._earlier = outbox.Orphans(
                lambda: spool.siblings(directory),
                cfg=cfg,
                shared_sender=self._box.sender,
                skip=self._box.spool.directory,
            )
        return self._box, self._earlier

    def close(self) -> None:
        """Release the spool (what is in it waits for the next controller)."""
        if self._earlier is not None:
            self._earlier.close()
        if self._box is not None:
            self._box.close()
        self._box = self._earlier = None


@dataclass(kw_only=True)
class CollectorControl:
    """Control requests for a job's ranks through the collector (the control path across nodes):
    the collector hands them to the node agent of each rank's node, which writes them into the
    rank's progress page and posts the SDK's acknowledgement back. `acknowledged` waits for
    every asked rank's acknowledgement. `request(timeout_s=...)` is a checkpoint (the
    controller's `Checkpointer`): an acknowledgement says only that a rank took the request, so
    it then waits, within the same `timeout_s`, for the job's `Checkpoint` record (what
    `vigil.agent.checkpoint_committed` ships) at a step past both the newest checkpoint and
    the job's last step before the request, and says which it saw. `stacks` returns each
    answering rank's own dump. Never raises for an outage: False / {} / an outcome saying so."""

    url: str
    job_id: str
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    poll_s: float = 0.2
    client: httpx.Client = field(default_factory=httpx.Client)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def acknowledged(
        self,
        *,
        timeout_s: float,
        kind: str = "checkpoint",
        ranks: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> bool:
        """Ask `ranks` (None: every rank of the job) to run their `kind` callback; True once
        all acknowledged within `timeout_s`."""
        status = self.post(kind, ranks=ranks, request_id=request_id)
        return status is not None and bool(self._await(status, timeout_s).get("done"))

    def request(
        self,
        *,
        timeout_s: float,
        ranks: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> ports.CheckpointOutcome:
        """Checkpoint now: post the request, wait for the acknowledgements, then for a
        checkpoint committed after it (all within `timeout_s`)."""
        deadline = self.clock() + timeout_s
        newest = self._newest_checkpoint()
        floor = self._last_step()
        status = self.post("checkpoint", ranks=ranks, request_id=request_id)
        if status is None:
            return ports.CheckpointOutcome(
                error=f"the collector at {self.url} did not take the request"
            )
        status = self._await(status, timeout_s)
        outcome = ports.CheckpointOutcome(
            acked=len(status.get("acked") or []), asked=len(status.get("expected") or [])
        )
        while outcome.asked:
            found = self._commit_after(newest, floor)
            if found is not None:
                step, location = found
                log.info("checkpoint of %s committed at step %d (%s)", self.job_id, step, location)
                return dataclasses.replace(outcome, committed_step=step, location=location)
            if self.clock() >= deadline:
                log.warning(
                    "checkpoint request for %s: %d of %d ranks acknowledged, no checkpoint past "
                    "step %d committed within %.0f s",
                    self.job_id,
                    outcome.acked,
                    outcome.asked,
                    max(newest, floor),
                    timeout_s,
                )
                break
            self.sleep(self.poll_s)
        return outcome

    def _newest_checkpoint(self) -> int:
        """The step of the job's newest checkpoint the collector holds (-1: none, or unknown)."""
        rows = self._get_list(f"/jobs/{self.job_id}/checkpoints", {"limit": 1})
        return max((int(r["step"]) for r in rows if isinstance(r.get("step"), int)), default=-1)

    def _last_step(self) -> int:
        """The newest step every rank of the job has reached, as far as the collector knows (the
        least of the ranks' last heartbeat steps; else the newest step any rank reported; -1:
        none, or unknown). A checkpoint taken for the request is at this step or later on any
        rank, even one that runs a step or more behind the fastest."""
        found = self._get(f"/jobs/{self.job_id}/state", None)
        if not isinstance(found, dict):
            return -1
        ranks = found.get("ranks")
        steps: list[int] = [
            r["last_step"]
            for r in (ranks if isinstance(ranks, list) else [])
            if isinstance(r, dict) and isinstance(r.get("last_step"), int) and r["last_step"] >= 0
        ]
        if steps:
            return min(steps)
        step = found.get("last_step")
        return step if isinstance(step, int) else -1

    def _commit_after(self, newest: int, floor: int) -> tuple[int, str] | None:
        """A checkpoint newer than `newest` at a step >= `floor` (step, location), if any."""
        rows = self._get_list(f"/jobs/{self.job_id}/checkpoints", {"limit": 10})
        fresh = [
            (int(r["step"]), str(r.get("location", "")))
            for r in rows
            if isinstance(r.get("step"), int) and r["step"] > newest and r["step"] >= floor
        ]
        return max(fresh) if fresh else None

    def _get(self, path: str, params: dict[str, Any] | None) -> object:
        url = f"{self.url.rstrip('/')}{api.API_PREFIX}{path}"
        try:
            response = self.client.get(
                url, params=params, headers=_headers(self.token), timeout=self.timeout_s
            )
            if response.status_code == 404:
                return None
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not read %s: %s", url, exc)
            return None

    def _get_list(self, path: str, params: dict[str, Any] | None) -> list[dict[str, Any]]:
        found = self._get(path, params)
        return [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []

    def stacks(
        self, ranks: Sequence[int], *, timeout_s: float, request_id: str | None = None
    ) -> dict[int, str]:
        """Ask `ranks` to dump their stacks (the SDK's own dump); each answering rank's dump."""
        status = self.post("dump_stacks", ranks=ranks, request_id=request_id)
        if status is None:
            return {}
        self._await(status, timeout_s)
        final = self.status(str(status["id"]), details=True) or {}
        details = final.get("details") or {}
        return {int(rank): str(text) for rank, text in details.items()}

    def _await(self, status: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if not status.get("expected"):  # the collector knows no rank of the job: none will answer
            log.warning(
                "control request %s (%s): the collector knows no ranks of job %s (do they report "
                "there?); not waiting",
                status.get("id"),
                status.get("kind"),
                self.job_id,
            )
            return status
        deadline = self.clock() + timeout_s
        while not status.get("done"):
            if self.clock() >= deadline:
                log.warning(
                    "control request %s (%s) for %s: acknowledged by %s of %s within %.0f s",
                    status.get("id"),
                    status.get("kind"),
                    self.job_id,
                    status.get("acked"),
                    status.get("expected"),
                    timeout_s,
                )
                return status
            self.sleep(self.poll_s)
            status = self.status(str(status["id"])) or status
        return status

    def post(
        self, kind: str, *, ranks: Sequence[int] | None = None, request_id: str | None = None
    ) -> dict[str, Any] | None:
        """Create the request (idempotent by `request_id`); its status, or None if not posted."""
        body: dict[str, Any] = {"kind": kind, "ranks": "all" if ranks is None else list(ranks)}
        if request_id is not None:
            body["id"] = request_id
        path = f"{self.url.rstrip('/')}{api.API_PREFIX}/jobs/{self.job_id}/control"
        try:
            response = self.client.post(
                path, json=body, headers=_headers(self.token), timeout=self.timeout_s
            )
            response.raise_for_status()
            found = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not post a %s request to %s: %s", kind, path, exc)
            return None
        return _control_status(found)

    def status(self, request_id: str, *, details: bool = False) -> dict[str, Any] | None:
        path = f"{self.url.rstrip('/')}{api.API_PREFIX}/jobs/{self.job_id}/control/{request_id}"
        try:
            response = self.client.get(
                path,
                params={"details": "true"} if details else None,
                headers=_headers(self.token),
                timeout=self.timeout_s,
            )
            response.raise_for_status()
            found = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not read control request %s: %s", request_id, exc)
            return None
        return _control_status(found)


def _control_status(found: object) -> dict[str, Any] | None:
    """A control request's status as the collector answers it; None for anything else (an older
    collector without the control routes, a proxy's page)."""
    if isinstance(found, dict) and isinstance(found.get("id"), str):
        return found
    log.warning("the collector's answer is not a control request: %.200r", found)
    return None


@dataclass(kw_only=True)
class CollectorApprovals:
    """`advise` mode: a change the controller would make is posted as a `proposed` action (through
    `actions`, upserted by id) and carried out only once a person approved it
    (`POST /api/v1/actions/{id}/approve`). `approved` waits at most `timeout_s`; a proposal
    already approved (a restarted controller) is not proposed again."""

    url: str
    actions: CollectorActions
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    poll_s: float = 1.0
    client: httpx.Client = field(default_factory=httpx.Client)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def approved(self, proposal: Action, *, timeout_s: float) -> bool:
        state = self.state(proposal.action_id)
        if state is None:
            self.actions.publish(proposal)
        deadline = self.clock() + timeout_s
        while state != ActionState.APPROVED.value:
            if self.clock() >= deadline:
                return False
            self.sleep(self.poll_s)
            state = self.state(proposal.action_id)
        return True

    def state(self, action_id: str) -> str | None:
        """The action's state in the collector; None when it is not there (or unreachable)."""
        path = f"{self.url.rstrip('/')}{api.API_PREFIX}/actions/{action_id}/approval"
        try:
            response = self.client.get(path, headers=_headers(self.token), timeout=self.timeout_s)
            if response.status_code == 404:
                return None
            response.raise_for_status()
            return str(response.json()["state"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("could not read the approval of %s: %s", action_id, exc)
            return None
