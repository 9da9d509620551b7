"""Ask a running job to checkpoint now, through the SDK's progress pages (the control channel).

The controller writes a "checkpoint" request into every local rank's page (the pages of the job's
live processes under the progress root, `<root>/<job>/<run>/`, or one run's alone when `run_id`
is given); the SDK runs the job's registered callback at its next step boundary and acknowledges.
Pages that exited processes left (an earlier attempt's, a crashed rank's) are skipped: they
would never acknowledge. Given `latest_committed` (how the
job tells its newest committed checkpoint), the outcome names the newer one committed after the
request; without it only the acknowledgements are known, and the outcome says commits are not
tracked (never that one committed). Bounded by a timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vigil.agent import progress, rundir
from vigil.recovery import ports

log = logging.getLogger(__name__)


def live_pages(progress_dir: Path, job_id: str, run_id: str | None = None) -> list[Path]:
    """The pages of `job_id`'s live local ranks (of run `run_id` alone when given)."""
    if run_id is None:
        pages = progress.discover(progress_dir, job_id)
    else:
        folder = rundir.run_path(progress_dir, job_id, run_id)
        pages = sorted(folder.glob(f"*{progress.PAGE_SUFFIX}")) if folder.is_dir() else []
    return [p for p in pages if _alive(p)]


def _alive(page: Path) -> bool:
    """The page's process still runs (its lock; old pages: its pid, `rundir.page_alive`)."""
    try:
        reader = progress.PageReader(page)
    except (OSError, ValueError):
        return False
    try:
        pid, pid_ns = int(reader.pid), reader.pid_ns
    finally:
        reader.close()
    return rundir.page_alive(page, pid=pid, pid_ns=pid_ns)


@dataclass(kw_only=True)
class PageCheckpointer:
    job_id: str
    # The ranks' progress root: $VIGIL_PROGRESS_DIR (as they see it), else /dev/shm/vigil.
    progress_dir: Path = field(default_factory=rundir.progress_root)
    # One run's pages only (the ranks' $VIGIL_RUN_ID); None: every live run of the job.
    run_id: str | None = None
    # Newest committed checkpoint step (-1 for none); None: acknowledgements suffice.
    latest_committed: Callable[[], int] | None = None
    poll_s: float = 0.1
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def request(self, *, timeout_s: float) -> ports.CheckpointOutcome:
        pages = live_pages(self.progress_dir, self.job_id, self.run_id)
        if not pages:
            log.warning(
                "no live progress pages for job %s under %s", self.job_id, self.progress_dir
            )
            return ports.CheckpointOutcome(
                error=f"no live progress pages of job {self.job_id} under {self.progress_dir}"
            )
        before = self.latest_committed() if self.latest_committed else -1
        readers, wanted = [], {}
        try:
            for path in pages:
                try:
                    reader = progress.PageReader(path)
                except (OSError, ValueError) as exc:
                    log.warning("skipping progress page %s: %s", path, exc)
                    continue
                readers.append(reader)
                wanted[path] = reader.request_control("checkpoint")
            deadline = self.clock() + timeout_s
            acked, newest = 0, before
            while True:
                acked = sum(r.acked() >= wanted[r.path] for r in readers)
                newest = self.latest_committed() if self.latest_committed else -1
                done = acked == len(readers) and self.latest_committed is None
                if done or newest > before or self.clock() >= deadline:
                    break
                self.sleep(self.poll_s)
            return ports.CheckpointOutcome(
                acked=acked,
                asked=len(readers),
                committed_step=newest if newest > before else None,
                tracked=self.latest_committed is not None,
            )
        finally:
            for reader in readers:
                reader.close()
