"""The node agent's end of the control path across nodes: collector -> this node's ranks.

Every `interval_s` the agent asks the collector for the control requests pending on its node
(`GET /api/v1/control?node=<node>`: checkpoint now, dump stacks, for ranks of jobs that run
here), writes each into the matching local rank's progress page (the page's control block, as
`vigil agent --request` does), and once the SDK acknowledged it there (its ack seq reached the
request's; reported one round later, once the callback the SDK runs right after its ack had
that time), posts the acknowledgement back (`POST /api/v1/control/<id>/ack`); a dump_stacks
acknowledgement carries the rank's newest dump from its stacks file (what the SDK just wrote).
A page holds one request at a time: a second request for the same rank waits until the first is
acknowledged or given up (`give_up_s`), so the SDK never misses one.

Bounded and fail-open: each call has the core sender's timeout (`SenderConfig.timeout_s`, at most
`MAX_TIMEOUT_S` so the watchdog's loop is never held up long), and a collector that is away or
answers nonsense costs one logged warning (then DEBUG until it answers again), never the agent.
Must not import the collector; touches training processes only through the pages' control
blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from vigil import api, sender
from vigil.agent import progress, rundir

log = logging.getLogger(__name__)

# The agent's loop also feeds the watchdog: one control call may hold it up at most this long.
MAX_TIMEOUT_S = 2.0
# A page whose SDK does not acknowledge within this long (a rank stuck in a step) is freed for
# the next request; the collector still lists the request as pending.
GIVE_UP_S = 300.0

# A dump_stacks answer carries at most this much of the rank's newest dump (the route's limit).
MAX_DETAIL = 64 * 1024
_DUMP_HEADER = "# vigil: "

# (job, rank, the page's reader) of every live local rank.
Pages = Callable[[], Iterable[tuple[str, int, progress.PageReader]]]


@dataclass
class _Delivery:
    request_id: str
    kind: str
    rank: int
    seq: int
    since_s: float
    reader: progress.PageReader
    # When the page's ack was first seen: the SDK acks a request as it takes it, then runs it,
    # so the agent reports the ack (and reads a dump) one round later.
    acked_s: float | None = None


@dataclass(kw_only=True)
class ControlPoller:
    cfg: sender.SenderConfig
    node: str
    pages: Pages
    interval_s: float = 1.0
    give_up_s: float = GIVE_UP_S
    client: httpx.Client | None = None
    clock: Callable[[], float] = time.monotonic
    delivered_requests: int = 0
    acked_requests: int = 0
    _next_s: float = field(default=0.0, init=False)
    _inflight: dict[tuple[str, int], _Delivery] = field(default_factory=dict, init=False)
    _done: set[tuple[str, int]] = field(default_factory=set, init=False)
    _unsent: dict[str, dict[int, str]] = field(default_factory=dict, init=False)
    _http: httpx.Client = field(init=False)
    # While the collector stays away (or has no control routes): one WARNING, then DEBUG.
    _failing: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.give_up_s <= 0:
            raise ValueError("ControlPoller needs interval_s > 0 and give_up_s > 0")
        timeout = min(self.cfg.timeout_s, MAX_TIMEOUT_S)
        self._http = self.client or httpx.Client(timeout=timeout)
        self._timeout_s = timeout
        self._base = self.cfg.collector_url.rstrip("/") + api.API_PREFIX
        self._headers = {"Authorization": f"Bearer {self.cfg.token}"} if self.cfg.token else {}

    def tick(self) -> None:
        """One round when due: acks seen so far go out, new requests go into pages."""
        now = self.clock()
        if now < self._next_s:
            return
        self._next_s = now + self.interval_s
        self._collect_acks(now)
        if not self._send_acks():
            return  # the collector is away: ask again next round
        pending = self._fetch()
        if pending is None:
            return
        self._deliver(pending, now)

    def close(self) -> None:
        if self.client is None:
            self._http.close()

    # -- the collector ------------------------------------------------------------------------
    def _fetch(self) -> list[dict[str, Any]] | None:
        try:
            response = self._http.get(
                f"{self._base}/control",
                params={"node": self.node},
                headers=self._headers,
                timeout=self._timeout_s,
            )
            response.raise_for_status()
            rows = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            self._failed("cannot fetch control requests for %s: %r", self.node, exc)
            return None
        if not isinstance(rows, list):
            self._failed("the collector's control requests are not a list: %.200r", rows)
            return None
        if self._failing:
            log.info("control requests for %s: the collector answers again", self.node)
            self._failing = False
        return [r for r in rows if _well_formed(r)]

    def _failed(self, message: str, *args: object) -> None:
        log.log(logging.DEBUG if self._failing else logging.WARNING, message, *args)
        self._failing = True

    def _send_acks(self) -> bool:
        for request_id, answers in list(self._unsent.items()):
            ranks = sorted(answers)
            details = {str(r): text for r, text in answers.items() if text}
            try:
                response = self._http.post(
                    f"{self._base}/control/{request_id}/ack",
                    json={"node": self.node, "ranks": ranks, "details": details},
                    headers=self._headers,
                    timeout=self._timeout_s,
                )
            except httpx.HTTPError as exc:
                self._failed("cannot acknowledge control request %s: %r", request_id, exc)
                return False
            if response.status_code >= 500:
                self._failed("collector answered %d to an ack; retrying", response.status_code)
                return False
            if response.status_code >= 400:  # expired or refused: nothing to retry
                log.warning(
                    "collector refused the ack of %s: %d %s",
                    request_id,
                    response.status_code,
                    response.text[:200],
                )
            else:
                self.acked_requests += 1
                log.info("control request %s acknowledged by ranks %s", request_id, ranks)
            del self._unsent[request_id]
        return True

    # -- the pages ----------------------------------------------------------------------------
    def _collect_acks(self, now: float) -> None:
        for key, d in list(self._inflight.items()):
            try:
                acked = d.reader.acked() >= d.seq
            except (ValueError, OSError):  # the daemon dropped the page: its rank is gone
                acked = False
                d.since_s = -self.give_up_s  # give up now
            if acked and d.acked_s is None:
                d.acked_s = now
            elif acked:
                detail = _last_dump(d.reader) if d.kind == "dump_stacks" else ""
                self._unsent.setdefault(d.request_id, {})[d.rank] = detail
                del self._inflight[key]
            elif now - d.since_s >= self.give_up_s:
                log.warning(
                    "rank %d did not acknowledge control request %s; giving up on it",
                    d.rank,
                    d.request_id,
                )
                del self._inflight[key]

    def _deliver(self, pending: list[dict[str, Any]], now: float) -> None:
        local = {(job, rank): reader for job, rank, reader in self.pages()}
        busy = {(id(d.reader)) for d in self._inflight.values()}
        wanted: set[tuple[str, int]] = set()
        for req in pending:
            for rank in req["ranks"]:
                key = (req["id"], rank)
                wanted.add(key)
                reader = local.get((req["job_id"], rank))
                if key in self._done or reader is None or id(reader) in busy:
                    continue  # delivered already, not here (yet), or the page is busy
                try:
                    seq = reader.request_control(req["kind"])
                except (ValueError, OSError) as exc:
                    log.warning("cannot write control request %s to rank %d: %s", key, rank, exc)
                    continue
                self._inflight[key] = _Delivery(req["id"], req["kind"], rank, seq, now, reader)
                self._done.add(key)
                busy.add(id(reader))
                self.delivered_requests += 1
                log.info(
                    "control request %s (%s) delivered to rank %d of %s",
                    req["id"],
                    req["kind"],
                    rank,
                    req["job_id"],
                )
        # Bounded memory: forget what the collector no longer lists (and nothing in flight).
        self._done &= wanted | set(self._inflight)


def _last_dump(reader: progress.PageReader) -> str:
    """The rank's newest stack dump: the last section of its stacks file beside its page."""
    path = reader.path.with_suffix(rundir.STACKS_SUFFIX)
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - MAX_DETAIL))
            tail = f.read().decode("utf-8", "replace")
    except OSError as exc:
        log.warning("cannot read the stacks of %s: %s", path, exc)
        return ""
    start = tail.rfind(_DUMP_HEADER)
    return tail[start:] if start >= 0 else tail


def _well_formed(row: object) -> bool:
    if not isinstance(row, dict):
        return False
    ok = (
        isinstance(row.get("id"), str)
        and isinstance(row.get("job_id"), str)
        and isinstance(row.get("kind"), str)
        and isinstance(row.get("ranks"), list)
        and all(isinstance(r, int) for r in row["ranks"])
    )
    if not ok:
        log.warning("skipping a malformed control request from the collector: %r", row)
    return ok
