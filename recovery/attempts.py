"""What the controller learns about an attempt's steps: where the failed one stopped, where the
next one resumed. Read from the ranks' own output, never from the training process.

Three sources, all written by the SDK:
- progress pages (`vigil.agent.progress`, node shared memory): each rank's last finished step,
  written at every step end, so they stay exact for a rank killed by SIGKILL; read at the
  failure, while the other ranks' pages are still there.
- offline step records (`<output dir>/<job>/rank-NNNNN[.attempt-N].jsonl`, when the job runs
  without a collector): the new attempt's first step and when it ended, exactly. Without them
  the pages give it too, approximately: a page shows the newest finished step when it is read,
  which is the first one only while steps take longer than the controller's poll interval.
- the collector's step records (`remote`, when the job ships there): the first step exactly, a
  flush or two later; the pages are used if none arrive within `REMOTE_GRACE_S`.

Definitions (tests/recovery/test_attempts.py): the last step trained before a failure is the
newest step every rank of the failed attempt had finished (a data-parallel step is trained once
all replicas finished it; a surviving rank may log the step that failed under it as finished);
the resume step is the lowest step the new attempt finished; steps lost = the steps in [resume
step, last trained] = max(0, last - resume + 1): the steps trained before the failure that had to
be trained again. Reads files; the collector only through `remote`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vigil import codec, schema
from vigil.agent import progress
from vigil.recovery.executor import RankExit

log = logging.getLogger(__name__)

_ATTEMPT_FILE = re.compile(r"^rank-(\d+)(?:\.attempt-(\d+))?\.jsonl$")
# How long a new attempt's records may take to reach the collector (the SDK flushes every second)
# before the pages' approximate first step is taken instead.
REMOTE_GRACE_S = 30.0
# A failed attempt's newest steps are at the end of its files: 1 MiB covers thousands of steps.
_TAIL_BYTES = 1 << 20


def records_file_attempt(path: Path) -> int | None:
    """The attempt an SDK JSONL file holds (`rank-00002.attempt-1.jsonl`: 1; no tag: 0), or
    None when the name is not an SDK rank file."""
    match = _ATTEMPT_FILE.match(path.name)
    if match is None:
        return None
    return int(match.group(2) or 0)


def crash_finding_id(job_id: str, attempt: int, rank: int) -> str:
    """The controller's crash finding id: findings are stored by id alone, so it names the job
    (hashed: job names may be 256 characters), the attempt and the first rank to exit."""
    job = hashlib.sha1(job_id.encode(), usedforsecurity=False).hexdigest()[:10]
    return f"crash-{job}-a{attempt}-r{rank}"


def describe_exit(code: int) -> str:
    """How a rank ended, in words: "was killed by SIGKILL", "exited with code 3"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def crash_finding(
    job_id: str,
    attempt: int,
    failed: Sequence[RankExit],
    last: dict[int, int] | None,
    *,
    now_s: float,
    left: Sequence[RankExit] = (),
) -> schema.Finding:
    """The crash of `attempt`: the first rank to exit, how (code or signal), and the step it
    died in (the one after its last finished step in `last`; -1 when that is not known).

    `left`: ranks of the attempt that exited cleanly before. One whose last finished step is
    behind its peers' left its training loop early (its data ran out first: uneven shards),
    and its peers' collectives then broke or timed out: it is the culprit, not the first of
    them to exit."""
    first = min(failed, key=lambda e: e.seen_s)
    early = _left_early(left, first, last)
    if early is not None and last is not None:
        return _left_early_finding(job_id, attempt, early, first, failed, last, now_s=now_s)
    rank, node, code = first.rank, first.node, first.returncode
    evidence = [
        schema.Evidence(metric="exit_code", observed=float(code), note=describe_exit(code)),
        schema.Evidence(metric="exit_time", observed=first.seen_s, unit="s"),
    ]
    died_in, where = -1, ""
    if last is not None and rank in last:
        died_in = last[rank] + 1
        evidence.append(schema.Evidence(metric="last_step", observed=float(last[rank])))
        where = f" in step {died_in}"
    elif last is not None and not last:  # no rank had finished a step
        died_in, where = 0, " before finishing a step"
    return schema.Finding(
        finding_id=crash_finding_id(job_id, attempt, rank),
        kind=schema.FindingKind.CRASH,
        job_id=job_id,
        subjects=schema.Subjects(ranks=[rank], nodes=[node]),
        step_start=died_in,
        step_end=died_in,
        summary=(
            f"rank {rank} on {node} {describe_exit(code)}{where} "
            f"(attempt {attempt}; first of {len(failed)} to exit)"
        ),
        evidence=evidence,
        confidence=1.0,
        detected_s=now_s,
    )


def _left_early(
    left: Sequence[RankExit], first: RankExit, last: dict[int, int] | None
) -> RankExit | None:
    """The first rank that exited cleanly, before `first` failed, behind its peers' steps."""
    if not left or not last:
        return None
    furthest = max(last.values())
    behind = [e for e in left if e.seen_s <= first.seen_s and last.get(e.rank, furthest) < furthest]
    return min(behind, key=lambda e: e.seen_s, default=None)


def _left_early_finding(
    job_id: str,
    attempt: int,
    early: RankExit,
    first: RankExit,
    failed: Sequence[RankExit],
    last: dict[int, int],
    *,
    now_s: float,
) -> schema.Finding:
    furthest = max(last.values())
    return schema.Finding(
        finding_id=crash_finding_id(job_id, attempt, early.rank),
        kind=schema.FindingKind.CRASH,
        job_id=job_id,
        subjects=schema.Subjects(ranks=[early.rank], nodes=[early.node]),
        step_start=last[early.rank] + 1,
        step_end=furthest,
        summary=(
            f"rank {early.rank} on {early.node} left its training loop after step "
            f"{last[early.rank]} and exited cleanly while its peers went on to step {furthest} "
            f"(uneven data across ranks?); then rank {first.rank} on {first.node} "
            f"{describe_exit(first.returncode)} (attempt {attempt}; first of {len(failed)} "
            "to fail)"
        ),
        evidence=[
            schema.Evidence(metric="exit_code", observed=0.0, note=describe_exit(0)),
            schema.Evidence(metric="exit_time", observed=early.seen_s, unit="s"),
            schema.Evidence(
                metric="last_step", observed=float(last[early.rank]), baseline=float(furthest)
            ),
        ],
        confidence=0.9,
        detected_s=now_s,
    )


def steps_lost(last_trained: int | None, resume_step: int) -> int:
    """Steps trained before the failure that were trained again; -1 when `last_trained` is
    unknown. `last_trained` -1 means no step had finished (nothing to lose)."""
    if last_trained is None or resume_step < 0:
        return -1
    return max(0, last_trained - resume_step + 1)


@dataclass(frozen=True)
class FirstStep:
    step: int
    seen_s: float  # when it ended on the first rank to finish it (Unix s)
    source: str  # "records" (exact) or "progress pages"


@dataclass
class _Reader:
    """Step records appended to one file since the controller started reading it."""

    path: Path
    offset: int = 0
    steps: list[schema.StepRecord] = field(default_factory=list)

    def read(self) -> None:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        for line in data[:end].splitlines():
            if b'"step"' not in line:
                continue
            try:
                record = codec.decode_json(line)
            except codec.DecodeError:
                continue
            if isinstance(record, schema.StepRecord):
                self.steps.append(record)


@dataclass(kw_only=True)
class ProgressWatch:
    """The controller's `StepWatch` over one job's progress pages and offline step records."""

    job_id: str
    # Where the SDK keeps progress pages (searched one folder deep, pages of this job only).
    progress_root: Path | None = None
    # `<output dir>/<job>`: the job's offline JSONL files (None: it ships to a collector).
    records_dir: Path | None = None
    # Step records elsewhere (the collector's, `collector_link.CollectorSteps`): the lowest step
    # started at or after a time, exact; asked when the job has no offline files.
    remote: Callable[[float], FirstStep | None] | None = None
    _readers: dict[Path, _Reader] = field(default_factory=dict, init=False)
    _pages_only_after_s: float = field(default=0.0, init=False)

    def last_steps(self, attempt: int, since_s: float) -> dict[int, int]:
        """Each rank's newest step finished since `since_s` in `attempt` (page or record)."""
        found = {
            page.rank: page.last.step
            for page in self._pages()
            if page.last.step >= 0 and page.last.end_wall_s >= since_s
        }
        for path in self._files(attempt):
            for record in _tail_steps(path):
                if record.job_id == self.job_id and record.start_s >= since_s:
                    found[record.rank] = max(found.get(record.rank, -1), record.step)
        return found

    def first_step(self, attempt: int, since_s: float) -> FirstStep | None:
        """The lowest step `attempt` finished (started at `since_s`), once one has."""
        files = self._files(attempt)
        if files:
            steps: list[schema.StepRecord] = []
            for path in files:
                reader = self._readers.setdefault(path, _Reader(path))
                reader.read()
                steps.extend(
                    s for s in reader.steps if s.job_id == self.job_id and s.start_s >= since_s
                )
            if not steps:
                return None
            low = min(s.step for s in steps)
            seen = min(s.end_s for s in steps if s.step == low)
            return FirstStep(low, seen, "records")
        if self.remote is not None:
            found = self.remote(since_s)
            if found is not None:
                return found
            if self._pages_only_after_s == 0.0:
                self._pages_only_after_s = time.monotonic() + REMOTE_GRACE_S
            if time.monotonic() < self._pages_only_after_s:
                return None  # its records lag the pages by a flush: wait for them a while
        pages = [
            p
            for p in self._pages()
            if p.last.step >= 0 and p.last.end_wall_s >= since_s and p.last.end_wall_s > 0
        ]
        if not pages:
            return None
        low = min(p.last.step for p in pages)
        seen = min(p.last.end_wall_s for p in pages if p.last.step == low)
        return FirstStep(low, seen, "progress pages")

    def forget(self) -> None:
        """Drop what was read (the attempt's first step is known)."""
        self._readers.clear()
        self._pages_only_after_s = 0.0

    def _files(self, attempt: int) -> list[Path]:
        if self.records_dir is None or not self.records_dir.is_dir():
            return []
        return sorted(
            p for p in self.records_dir.glob("rank-*.jsonl") if records_file_attempt(p) == attempt
        )

    def _pages(self) -> list[progress.PageSnapshot]:
        if self.progress_root is None:
            return []
        snaps = []
        for path in progress.discover(self.progress_root):
            try:
                reader = progress.PageReader(path)
            except (OSError, ValueError):
                continue  # a page being created or removed right now
            try:
                if reader.job == self.job_id:
                    snaps.append(reader.snapshot())
            except (OSError, TimeoutError) as exc:
                log.debug("skipping progress page %s: %s", path, exc)
            finally:
                reader.close()
        return snaps


def _tail_steps(path: Path) -> list[schema.StepRecord]:
    """The step records in the last `_TAIL_BYTES` of `path`."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - _TAIL_BYTES))
            data = fh.read()
    except OSError:
        return []
    if size > _TAIL_BYTES:
        data = data[data.find(b"\n") + 1 :]  # the first line is cut
    out = []
    for line in data.splitlines():
        if b'"step"' not in line:
            continue
        try:
            record = codec.decode_json(line)
        except codec.DecodeError:
            continue
        if isinstance(record, schema.StepRecord):
            out.append(record)
    return out
