"""The file side of `vigil analyze PATH`: find SDK JSONL files, Kineto traces and Flight Recorder
dumps under a path, read them, and collect everything into one `Report` (the detectors run in
`engine`, over the records read here).

Files are recognised by content, not name: `*.jsonl` are SDK record lines (dispatched by their
`type` tag), JSON starting like a Chrome trace is Kineto, JSON or pickle shaped like torch's
Flight Recorder output is a dump, and `*stack*.txt` files are per-rank py-spy or faulthandler
dumps whose stacks are grouped by identity and attached to hang findings. A restarted job's
files (`rank-NNNNN.attempt-A.jsonl`, and the controller's `controller.jsonl` of crashes and
actions) become its attempts (`attempts`): the detectors see each step as its newest attempt
trained it, the report shows each attempt, its crash and restart. A corrupt or
truncated file is reported with its name and the reason, and the remaining files are still
analysed. Reads the given files only; no other I/O.
"""

from __future__ import annotations

import logging
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from vigil import codec, schema
from vigil.analyzer import attempts as attempts_mod
from vigil.analyzer import config as config_mod
from vigil.analyzer import engine, findings, kineto, kineto_analysis, stacks
from vigil.analyzer import flight_recorder as fr

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, current file)

# A rank is reported as lagging in Kineto traces when it starts at least this share of matched
# collectives last and its median lateness is at least MIN_LATENESS_US.
LAG_SHARE = 0.75
MIN_LATENESS_US = 1000.0
MIN_MATCHED = 4


@dataclass(frozen=True, kw_only=True)
class FileError:
    path: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class RankTraceSummary:
    """One Kineto trace: the figures HolisticTraceAnalysis also computes, and more."""

    path: str
    rank: int
    breakdown: kineto_analysis.Breakdown
    overlap_pct: float
    top_kernels: list[kineto_analysis.KernelStat]
    num_collectives: int
    collective_ops: dict[str, int]
    collectives: list[kineto_analysis.CollectiveStat]


@dataclass(kw_only=True)
class Report:
    findings: list[schema.Finding] = field(default_factory=list)
    traces: list[RankTraceSummary] = field(default_factory=list)
    alignment: kineto_analysis.Alignment | None = None
    lags: list[kineto_analysis.Lag] = field(default_factory=list)
    errors: list[FileError] = field(default_factory=list)
    stack_groups: list[tuple[list[int], tuple[str, ...]]] = field(default_factory=list)
    # A restarted job's attempts (empty when every job ran once without a crash on record).
    attempts: list[attempts_mod.Attempt] = field(default_factory=list)
    # The recovery controller's actions found (controller.jsonl), each in its newest state.
    actions: list[schema.Action] = field(default_factory=list)
    num_records: int = 0
    num_dumps: int = 0
    files: int = 0


def discover(path: Path) -> list[Path]:
    """Candidate files under `path` (or `path` itself), in a stable order."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def classify(path: Path) -> str:
    """The file's kind: jsonl, kineto, dump, stacks, or "" (not ours), from name and first bytes."""
    if path.suffix == ".jsonl":
        return "jsonl"
    if path.suffix == ".txt":
        return "stacks" if "stack" in path.name.lower() else ""
    try:
        with path.open("rb") as fh:
            head = fh.read(4096)
        if path.suffix == ".gz":
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 4096)
    except (OSError, zlib.error):
        return "kineto" if path.name.endswith((".json.gz", ".json")) else ""
    if b'"traceEvents"' in head or b'"schemaVersion"' in head:
        return "kineto"
    if fr.looks_like_dump(head):
        return "dump"
    return "kineto" if path.name.endswith((".json.gz", ".json")) else ""


def analyze_path(
    path: str | Path,
    *,
    job_id: str | None = None,
    config: config_mod.AnalyzerConfig | None = None,
    progress: Progress | None = None,
) -> Report:
    """Analyse everything vigil understands under `path`."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    files = [(p, classify(p)) for p in discover(root)]
    files = [(p, kind) for p, kind in files if kind]
    total = sum(p.stat().st_size for p, _ in files) or 1
    done = 0
    report = Report(files=len(files))
    tagged: list[tuple[int, schema.Record]] = []
    traces: list[kineto.KinetoTrace] = []
    dumps: dict[Path, list[fr.Dump]] = defaultdict(list)
    rank_stacks: dict[int, tuple[str, ...]] = {}
    for p, kind in files:
        if progress is not None:
            progress(done, total, str(p))
        try:
            if kind == "jsonl":
                attempt = attempt_of(p)
                tagged.extend((attempt, r) for r in _read_jsonl(p, report))
            elif kind == "kineto":
                traces.append(kineto.load(p))
            elif kind == "stacks":
                _read_stack(p, rank_stacks, report)
            else:
                dumps[p.parent].append(fr.load(p))
        except (kineto.TraceError, fr.DumpError) as exc:
            report.errors.append(FileError(path=str(p), reason=exc.reason))
        done += p.stat().st_size
    if progress is not None:
        progress(total, total, "")
    default_job = job_id or (root.name if root.is_dir() else root.parent.name) or "job"
    report.num_records = len(tagged)
    # The controller's own record: its crash findings are findings; its actions are kept apart.
    controller_findings = [r for _, r in tagged if isinstance(r, schema.Finding)]
    report.actions = attempts_mod.final_actions(r for _, r in tagged)
    records = [
        r
        for r in attempts_mod.latest_steps(tagged)
        if not isinstance(r, schema.Finding | schema.Action)
    ]
    if any(isinstance(r, schema.StepRecord) for r in records):
        restarted = any(attempt > 0 for attempt, _ in tagged)
        report.findings.extend(engine.analyze_records(records, config, replay=not restarted))
        if restarted:  # each attempt's hangs and crash from its own records
            report.findings.extend(engine.replay_attempts(tagged, config))
    # The controller saw its job's ranks exit, first and for certain: its crash findings stand
    # for the crash rule's guesses from the records (a killed rank's last records are lost).
    witnessed = {f.job_id for f in controller_findings if f.kind is schema.FindingKind.CRASH}
    report.findings = [
        f
        for f in report.findings
        if not (f.kind is schema.FindingKind.CRASH and f.job_id in witnessed)
    ]
    seen = {f.finding_id for f in report.findings}
    report.findings.extend(
        {f.finding_id: f for f in controller_findings if f.finding_id not in seen}.values()
    )
    report.attempts = attempts_mod.summarize(tagged, report.actions, controller_findings)
    _kineto(traces, report, default_job)
    for folder, group in dumps.items():
        report.num_dumps += len(group)
        report.findings.extend(
            fr.analyze(_unique_ranks(group), job_id=job_id or folder.name or default_job)
        )
    if rank_stacks:
        report.stack_groups = stacks.group(rank_stacks)
        report.findings = [_with_stacks(f, report.stack_groups) for f in report.findings]
    return report


def attempt_of(path: Path) -> int:
    """The attempt an SDK file holds: N for `rank-NNNNN.attempt-N.jsonl`, else 0."""
    stem = path.name.removesuffix(".jsonl")
    _, sep, number = stem.rpartition(".attempt-")
    return int(number) if sep and number.isdigit() else 0


def _read_stack(p: Path, into: dict[int, tuple[str, ...]], report: Report) -> None:
    rank = stacks.rank_of(p)
    try:
        frames = stacks.parse(p.read_text(errors="replace"))
    except OSError as exc:
        report.errors.append(FileError(path=str(p), reason=f"cannot read ({exc})"))
        return
    if rank is None or not frames:
        why = "no rank number in the file name" if rank is None else "no py-spy/faulthandler frames"
        report.errors.append(FileError(path=str(p), reason=why))
        return
    into[rank] = frames


def _with_stacks(
    finding: schema.Finding, groups: list[tuple[list[int], tuple[str, ...]]]
) -> schema.Finding:
    """Hang findings gain one evidence line per stack group (largest first)."""
    if finding.kind != schema.FindingKind.HANG or any(
        e.metric == "stack_group_ranks" for e in finding.evidence
    ):
        return finding
    extra = [
        findings.evidence(
            "stack_group_ranks", len(ranks), note=f"ranks {ranks}: {' <- '.join(frames[:3])}"
        )
        for ranks, frames in groups[:4]
    ]
    return msgspec.structs.replace(finding, evidence=[*finding.evidence, *extra])


def _unique_ranks(group: list[fr.Dump]) -> list[fr.Dump]:
    """One dump per rank (a folder may hold both encodings of the same dump)."""
    by_rank: dict[int, fr.Dump] = {}
    for d in group:
        have = by_rank.get(d.rank)
        if have is None or _frames(d) > _frames(have):  # prefer the encoding with stacks
            by_rank[d.rank] = d
    return list(by_rank.values())


def _frames(d: fr.Dump) -> int:
    return sum(len(e.frames) for e in d.entries)


def _read_jsonl(p: Path, report: Report) -> list[schema.Record]:
    out = []
    bad = 0
    try:
        with p.open("rb") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    out.append(codec.decode_json(line))
                except codec.DecodeError as exc:
                    bad += 1
                    if bad <= 3:
                        report.errors.append(FileError(path=f"{p}:{number}", reason=str(exc)))
    except OSError as exc:
        report.errors.append(FileError(path=str(p), reason=f"cannot read ({exc})"))
    if bad > 3:
        report.errors.append(FileError(path=str(p), reason=f"{bad} undecodable lines in all"))
    return out


def _kineto(traces: list[kineto.KinetoTrace], report: Report, job_id: str) -> None:
    for t in sorted(traces, key=lambda t: t.rank):
        if not t.has_gpu:
            report.errors.append(
                FileError(
                    path=t.path, reason="no GPU kernels (CPU-only trace): nothing to break down"
                )
            )
            continue
        colls = kineto_analysis.collectives(t)
        ops: dict[str, int] = defaultdict(int)
        for meta in t.nccl.values():
            ops[meta.op] += 1
        report.traces.append(
            RankTraceSummary(
                path=t.path,
                rank=t.rank,
                breakdown=kineto_analysis.temporal_breakdown(t),
                overlap_pct=kineto_analysis.comm_comp_overlap_pct(t),
                top_kernels=kineto_analysis.kernel_breakdown(t, top=5),
                num_collectives=len(colls),
                collective_ops=dict(ops),
                collectives=kineto_analysis.collective_stats(t),
            )
        )
    jobs: dict[tuple[str, int, str], dict[int, kineto.KinetoTrace]] = defaultdict(dict)
    for t in traces:
        if t.has_gpu:  # ranks of one job: same folder, world size and backend
            jobs[(str(Path(t.path).parent), t.world_size, t.backend)].setdefault(t.rank, t)
    for ranks in jobs.values():
        if len(ranks) < 2:
            continue
        alignment = kineto_analysis.align_clocks(list(ranks.values()))
        if alignment is None:
            continue
        report.alignment = alignment
        report.lags = kineto_analysis.lagging_ranks(list(ranks.values()), alignment)
        if alignment.matched >= MIN_MATCHED:
            report.findings.extend(_lag_findings(report.lags, alignment, job_id))


def _lag_findings(
    lags: list[kineto_analysis.Lag], alignment: kineto_analysis.Alignment, job_id: str
) -> list[schema.Finding]:
    out = []
    for lag in lags:
        if lag.last_share >= LAG_SHARE and lag.median_lateness_us >= MIN_LATENESS_US:
            out.append(
                findings.make_finding(
                    kind=schema.FindingKind.STRAGGLER,
                    job_id=job_id,
                    subjects=schema.Subjects(ranks=[lag.rank]),
                    step_start=-1,
                    step_end=-1,
                    summary=(
                        f"rank {lag.rank} starts {lag.last_share:.0%} of matched collectives last, "
                        f"{lag.median_lateness_us / 1000:.2f} ms late (median), clocks aligned"
                    ),
                    evidence=[
                        findings.evidence("arrived_last_share", lag.last_share, 1.0 / len(lags)),
                        findings.evidence("collective_lateness", lag.median_lateness_us, unit="us"),
                        findings.evidence(
                            "clock_residual_skew",
                            alignment.residual_us.get(lag.rank, 0.0),
                            unit="us",
                        ),
                    ],
                    confidence=0.7,
                )
            )
    return out
