"""What a sender makes of the collector's answers, and when it tries again: pure rules, no I/O.

`classify` maps an HTTP status to an `Outcome`; `backoff_delays` is the one retry schedule;
`is_poison` says when a batch the collector keeps failing on is set aside (quarantined) instead
of blocking the batches behind it; `Throttle` and `OutageLog` decide what to say about an
unreachable collector, and how often. Shared by every sender (`vigil.sender`); no sockets, no
files, no subsystem imports.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

# Not the batch's fault, so never a reason to set it aside: the token is wrong or lacks a scope
# (fixed by configuration), the collector timed out reading it, or asks senders to slow down.
RETRY_LATER = frozenset({401, 403, 408, 429})


class Outcome(enum.StrEnum):
    COMMITTED = "committed"  # 2xx: stored (idempotent by batch id)
    REJECTED = "rejected"  # a 4xx that retrying cannot change (400, 413, 422, ...): quarantine now
    REFUSED = "refused"  # 5xx: the collector failed on it; counts towards quarantine
    UNAVAILABLE = "unavailable"  # nobody listening, timeouts, RETRY_LATER, shutdown deadline


def classify(status_code: int) -> Outcome:
    if 200 <= status_code < 300:
        return Outcome.COMMITTED
    if status_code in RETRY_LATER or status_code < 200 or 300 <= status_code < 400:
        return Outcome.UNAVAILABLE
    if status_code < 500:
        return Outcome.REJECTED
    return Outcome.REFUSED


def backoff_delays(initial_s: float, max_s: float, attempts: int) -> Iterator[float]:
    """The one backoff schedule: 0 before the first attempt, then doubling up to `max_s`."""
    delay = initial_s
    for attempt in range(attempts):
        yield 0.0 if attempt == 0 else delay
        if attempt:
            delay = min(delay * 2.0, max_s)


def is_poison(
    *, refusals: int, commits_at_first_refusal: int, commits_now: int, max_refusals: int
) -> bool:
    """A batch is set aside after `max_refusals` 5xx answers, once the collector has committed
    some other batch since it first refused this one: a collector answering 5xx to everything
    (starting up, its store down) is an outage, and sets nothing aside."""
    return refusals >= max_refusals and commits_now > commits_at_first_refusal


class Throttle:
    """Lets a message through at most once per `interval_s` and counts the ones held back."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self.held_back = 0

    def ready(self) -> int | None:
        """The number held back since the last one let through, or None to hold this one."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.held_back += 1
            return None
        self._last, held = now, self.held_back
        self.held_back = 0
        return held

    def reset(self) -> None:
        self._last = None
        self.held_back = 0


class OutageLog:
    """WARNING when delivery to `url` first fails, again at most every `interval_s` while it
    keeps failing (with what is pending), INFO when it resumes. `retried` says when the spooled
    batches go again ("every flush" for the SDK, "at the next run" for `vigil diag`)."""

    def __init__(
        self,
        url: str,
        *,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
        retried: str = "every flush",
    ) -> None:
        self.url = url
        self.retried = retried
        self._clock = clock
        self._log = logger
        self._throttle = Throttle(interval_s, clock)
        self._since: float | None = None
        self.failures = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, error: str, *, pending_batches: int, pending_bytes: int) -> None:
        now = self._clock()
        self.failures += 1
        if self._since is None:
            self._since = now
            self._throttle.reset()
            self._throttle.ready()
            self._log.warning(
                "cannot deliver to the collector at %s: %s; batches wait in the spool "
                "(%d pending) and are retried %s",
                self.url,
                error,
                pending_batches,
                self.retried,
            )
        elif self._throttle.ready() is not None:
            self._log.warning(
                "still cannot deliver to the collector at %s after %.0f s (%d failed rounds): "
                "%s; %d batches (%d bytes) pending in the spool",
                self.url,
                now - self._since,
                self.failures,
                error,
                pending_batches,
                pending_bytes,
            )

    def delivered(self, *, pending_batches: int) -> None:
        if self._since is None:
            return
        self._log.info(
            "delivery to the collector at %s resumed after %.0f s (%d failed rounds); "
            "%d batches still spooled",
            self.url,
            self._clock() - self._since,
            self.failures,
            pending_batches,
        )
        self._since = None
        self.failures = 0
