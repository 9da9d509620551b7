"""Ask a running job to checkpoint now, through the SDK's progress pages (the control channel).

The controller writes a "checkpoint" request into every local rank's page; the SDK runs the job's
registered callback at its next step boundary and acknowledges. Given `latest_committed` (how the
job tells its newest committed checkpoint), the request succeeds only once a newer one exists;
otherwise the acknowledgements are the answer. Bounded by a timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vigil.agent import progress

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PageCheckpointer:
    progress_dir: Path
    job_id: str
    # Newest committed checkpoint step (-1 for none); None: acknowledgements suffice.
    latest_committed: Callable[[], int] | None = None
    poll_s: float = 0.1
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def request(self, *, timeout_s: float) -> bool:
        pages = sorted((self.progress_dir / self.job_id).glob(f"*{progress.PAGE_SUFFIX}"))
        if not pages:
            log.warning("no progress pages for job %s under %s", self.job_id, self.progress_dir)
            return False
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
            while self.clock() < deadline:
                acked = all(r.acked() >= wanted[r.path] for r in readers)
                if acked and (self.latest_committed is None or self.latest_committed() > before):
                    return True
                self.sleep(self.poll_s)
            return False
        finally:
            for reader in readers:
                reader.close()
