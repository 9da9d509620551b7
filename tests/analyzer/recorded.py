"""Recorded real jobs for analyzer tests: the SDK's JSONL under data/, analysed offline or fed
to the streaming analyzer as the collector feeds it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from vigil import codec, schema
from vigil.analyzer import config, engine, streaming

DATA = Path(__file__).parent / "data"


def records(folder: Path) -> list[schema.Record]:
    return [r for path in sorted(folder.glob("*.jsonl")) for r in records_of(path)]


def records_of(path: Path) -> list[schema.Record]:
    """One JSONL file's records, in the order they were written."""
    return [codec.decode_json(line) for line in path.read_text().splitlines() if line.strip()]


def streamed(
    found_in: list[schema.Record], cfg: config.AnalyzerConfig, *, last_state: bool = False
) -> list[schema.Finding]:
    """Fed as the collector feeds them: every rank's records of one step in one batch; each
    finding ever open, in the last version sent open (the collector upserts re-sent ones),
    or with `last_state` in the last version sent (resolved where it was resolved)."""
    by_step: dict[int, list[schema.Record]] = defaultdict(list)
    for r in found_in:
        by_step[getattr(r, "step", -1)].append(r)
    analyzer = streaming.StreamingAnalyzer(cfg)
    sent: dict[str, schema.Finding] = {}
    for step in sorted(by_step):
        for f in analyzer.observe(by_step[step]):
            if last_state or f.state == schema.FindingState.OPEN:
                sent[f.finding_id] = f
    return list(sent.values())


def streamed_in_time(
    found_in: list[schema.Record], cfg: config.AnalyzerConfig
) -> list[schema.Finding]:
    """Fed one record at a time in the order the ranks sent them (a heartbeat at its time, a
    step's records when the step ended), the analyzer ticked after each: a collector whose
    ranks' shipments arrive one by one. Each finding ever sent, in the last version sent."""
    ends = {(r.rank, r.step): r.end_s for r in found_in if isinstance(r, schema.StepRecord)}

    def sent_s(r: schema.Record) -> float:
        if isinstance(r, schema.Heartbeat):
            return r.time_s
        return ends.get((getattr(r, "rank", -1), getattr(r, "step", -1)), 0.0)

    analyzer = streaming.StreamingAnalyzer(cfg)
    sent: dict[str, schema.Finding] = {}
    for r in sorted(found_in, key=sent_s):  # stable: a step record before its aggregates
        now = sent_s(r)
        for f in [*analyzer.observe([r]), *(analyzer.tick(now) if now else [])]:
            sent[f.finding_id] = f
    return list(sent.values())


def analyse(
    mode: str, found_in: list[schema.Record], cfg: config.AnalyzerConfig | None = None
) -> list[schema.Finding]:
    """Findings of `mode` ("offline": `engine.analyze_records`, "online": `streamed`)."""
    cfg = cfg or config.AnalyzerConfig()
    return engine.analyze_records(found_in, cfg) if mode == "offline" else streamed(found_in, cfg)


def named(found: list[schema.Finding]) -> list[tuple[str, list[int]]]:
    return [(f.kind.value, f.subjects.ranks) for f in found]
