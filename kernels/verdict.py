"""Judging measurements: fleet baseline (SuperBench's 5 % rule) and the device's spec sheet.

Pure: takes measurements, a fleet baseline and spec figures, returns `vigil.schema.DiagResult`
records. A performance figure more than 5 % worse than the fleet median is suspect, as is one
below its spec-sheet floor; any wrong result (an error count above zero, a checksum that differs
from the exact reference or from the fleet) fails. Reads files only in `FleetBaseline.load`.
"""

from __future__ import annotations

import collections
import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vigil import codec, schema
from vigil.kernels import measurement, spec

# SuperBench's rule: a node more than 5 % worse than the fleet's median is an outlier.
FLEET_TOLERANCE = 0.05
_M = measurement.Kind


@dataclass(frozen=True, kw_only=True)
class FleetBaseline:
    """Per test, the fleet's median value (its most common value for checksums)."""

    values: Mapping[str, float] = field(default_factory=dict)
    tolerance: float = FLEET_TOLERANCE

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"fleet tolerance must be in [0, 1), got {self.tolerance}")

    def get(self, test: str) -> float | None:
        return self.values.get(test)

    @classmethod
    def from_records(cls, records: Iterable[schema.DiagResult]) -> FleetBaseline:
        """Medians over earlier diag results of the fleet (one device kind per baseline)."""
        by_test: dict[str, list[float]] = collections.defaultdict(list)
        for record in records:
            by_test[record.test].append(record.value)
        values = {}
        for test, seen in by_test.items():
            if test.endswith(".checksum"):
                values[test] = collections.Counter(seen).most_common(1)[0][0]
            else:
                values[test] = statistics.median(seen)
        return cls(values=values)

    @classmethod
    def load(cls, path: Path) -> FleetBaseline:
        """Read `{"test": value, ...}` JSON or JSON lines of diag results (`vigil diag --json`)."""
        text = path.read_text(encoding="utf-8")
        stripped = text.lstrip()
        if stripped.startswith("{") and '"type"' not in stripped.split("\n", 1)[0]:
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not a JSON object of test -> value: {exc}") from exc
            return cls(values={str(k): float(v) for k, v in raw.items()})
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = codec.decode_json(line)
            except codec.DecodeError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc
            if isinstance(record, schema.DiagResult):
                records.append(record)
        if not records:
            raise ValueError(f"{path}: holds no diag results")
        return cls.from_records(records)


def judge(
    m: measurement.Measurement,
    *,
    baseline: float | None,
    figure: spec.SpecFigure | None,
    tolerance: float = FLEET_TOLERANCE,
) -> schema.Verdict:
    if m.kind is _M.ERRORS:
        return schema.Verdict.FAIL if m.value > 0 else schema.Verdict.PASS
    if m.kind is _M.CHECKSUM:
        return _judge_checksum(m.value, baseline=baseline, expected=m.expected)
    if m.kind is _M.INFO:
        return schema.Verdict.UNKNOWN
    checks = []
    if baseline is not None and baseline > 0:
        checks.append(_within_fleet(m, baseline, tolerance))
    if figure is not None:
        checks.append(m.value >= figure.minimum if m.higher_is_better else m.value <= figure.peak)
    if not checks:
        return schema.Verdict.UNKNOWN
    return schema.Verdict.PASS if all(checks) else schema.Verdict.SUSPECT


def _within_fleet(m: measurement.Measurement, baseline: float, tolerance: float) -> bool:
    if m.higher_is_better:
        return m.value >= baseline * (1 - tolerance)
    return m.value <= baseline * (1 + tolerance)


def _judge_checksum(
    value: float, *, baseline: float | None, expected: float | None
) -> schema.Verdict:
    references = [r for r in (expected, baseline) if r is not None]
    if not references:
        return schema.Verdict.UNKNOWN
    return schema.Verdict.PASS if all(value == r for r in references) else schema.Verdict.FAIL


def to_results(
    measurements: Iterable[measurement.Measurement],
    *,
    node: str,
    device_id: str,
    sheet: Mapping[str, spec.SpecFigure],
    fleet: FleetBaseline,
    time_s: float,
) -> list[schema.DiagResult]:
    """Judge each measurement and wrap it as the wire record the collector stores."""
    results = []
    for m in measurements:
        figure = sheet.get(m.spec_key) if m.spec_key else None
        baseline = fleet.get(m.test)
        results.append(
            schema.DiagResult(
                node=node,
                device=device_id,
                test=m.test,
                value=m.value,
                unit=m.unit,
                baseline=baseline,
                spec=figure.peak if figure else m.expected,
                verdict=judge(m, baseline=baseline, figure=figure, tolerance=fleet.tolerance),
                time_s=time_s,
            )
        )
    return results
