"""Findings the analyzer builds always fit the wire's bounds, however many subjects a fault has."""

from __future__ import annotations

from vigil import codec, schema
from vigil.analyzer import findings


def test_analyzer_findings_stay_within_the_wire_bounds() -> None:
    made = findings.make_finding(
        kind=schema.FindingKind.HANG,
        job_id="j",
        subjects=schema.Subjects(ranks=list(range(10_000))),
        summary="s" * 10_000,
        evidence=[findings.evidence("m", 1.0)] * 100,
        confidence=0.9,
    )
    decoded = codec.decode_batch(codec.encode_batch([made])).records[0]
    assert isinstance(decoded, schema.Finding)
    assert len(decoded.subjects.ranks) == schema.MAX_SUBJECTS
    assert len(decoded.evidence) == schema.MAX_EVIDENCE
