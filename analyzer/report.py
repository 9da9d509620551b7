"""Rendering an offline `Report` as text for people or as JSON for tools. No I/O."""

from __future__ import annotations

from typing import Any

import msgspec

from vigil.analyzer import attempts, offline


def to_dict(report: offline.Report) -> dict[str, Any]:
    """A JSON-ready dict; findings keep the wire schema's field names."""
    return {
        "findings": [msgspec.to_builtins(f) for f in report.findings],
        "traces": [
            {
                "path": t.path,
                "rank": t.rank,
                "idle_pct": round(t.breakdown.idle_pct, 2),
                "compute_pct": round(t.breakdown.compute_pct, 2),
                "non_compute_pct": round(t.breakdown.non_compute_pct, 2),
                "span_us": t.breakdown.span_us,
                "comm_comp_overlap_pct": round(t.overlap_pct, 2),
                "num_collectives": t.num_collectives,
                "collective_ops": t.collective_ops,
                "top_kernels": [
                    {
                        "name": k.name,
                        "kind": k.kind,
                        "count": k.count,
                        "total_us": k.total_us,
                        "share_pct": round(k.share_pct, 2),
                    }
                    for k in t.top_kernels
                ],
            }
            for t in report.traces
        ],
        "clock_alignment": None
        if report.alignment is None
        else {
            "reference_rank": report.alignment.reference_rank,
            "offsets_us": {str(k): v for k, v in report.alignment.offsets_us.items()},
            "residual_us": {str(k): v for k, v in report.alignment.residual_us.items()},
            "matched_collectives": report.alignment.matched,
        },
        "lagging": [
            {
                "rank": lag.rank,
                "last_share": lag.last_share,
                "median_lateness_us": lag.median_lateness_us,
            }
            for lag in report.lags
        ],
        "stack_groups": [{"ranks": r, "frames": list(f)} for r, f in report.stack_groups],
        "attempts": attempts.to_dicts(report.attempts),
        "actions": [msgspec.to_builtins(a) for a in report.actions],
        "errors": [{"path": e.path, "reason": e.reason} for e in report.errors],
        "files": report.files,
        "records": report.num_records,
        "flight_recorder_dumps": report.num_dumps,
    }


def to_text(report: offline.Report) -> str:
    lines = [
        f"vigil analyze: {report.files} file(s), {report.num_records} record(s), "
        f"{len(report.traces)} Kineto trace(s), {report.num_dumps} Flight Recorder dump(s)"
    ]
    if report.traces:
        lines.append("")
        lines.append("GPU time per rank (idle / compute / non-compute %, comm-comp overlap %):")
        for t in report.traces:
            b = t.breakdown
            lines.append(
                f"  rank {t.rank:>5}: {b.idle_pct:6.2f} / {b.compute_pct:6.2f} / "
                f"{b.non_compute_pct:6.2f}   overlap {t.overlap_pct:6.2f}   "
                f"collectives {t.num_collectives}"
            )
            for k in t.top_kernels[:3]:
                lines.append(f"      {k.share_pct:5.1f}%  {k.kind:<13} x{k.count:<5} {k.name[:90]}")
            for c in t.collectives[:3]:
                size = f"{c.total_bytes / 2**20:.1f} MiB" if c.total_bytes >= 0 else "size n/a"
                lines.append(
                    f"      nccl {c.op} {c.dtype} {c.algorithm}/{c.protocol} "
                    f"group {c.group or '?'}: x{c.count}, {size}, {c.total_us / 1000:.2f} ms"
                )
    if report.alignment is not None:
        a = report.alignment
        lines.append("")
        lines.append(
            f"Clock alignment on {a.matched} matched collective(s), "
            f"reference rank {a.reference_rank}:"
        )
        for rank, offset in sorted(a.offsets_us.items()):
            lines.append(
                f"  rank {rank:>5}: offset {offset:12.1f} us, "
                f"residual skew {a.residual_us[rank]:10.1f} us"
            )
    if report.stack_groups:
        lines.append("")
        lines.append(f"Stacks ({len(report.stack_groups)} distinct, largest group first):")
        for ranks, frames in report.stack_groups:
            shown = ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")
            lines.append(f"  {len(ranks)} rank(s) [{shown}]:")
            lines.extend(f"      {frame}" for frame in frames[:6])
    lines.extend(attempts.lines(report.attempts, report.findings))
    lines.append("")
    if report.findings:
        lines.append(f"Findings ({len(report.findings)}):")
        for f in sorted(report.findings, key=lambda f: (str(f.kind), f.step_start)):
            steps = f" steps {f.step_start}-{f.step_end}" if f.step_start >= 0 else ""
            lines.append(f"  [{f.kind}] {f.summary} (confidence {f.confidence:.2f}{steps})")
            for e in f.evidence:
                base = f" vs {e.baseline:g}" if e.baseline is not None else ""
                note = f"  ({e.note})" if e.note else ""
                lines.append(f"      {e.metric}: {e.observed:g}{base} {e.unit}{note}".rstrip())
    else:
        lines.append("No findings.")
    if report.errors:
        lines.append("")
        lines.append(f"Could not analyse ({len(report.errors)}):")
        lines.extend(f"  {e.path}: {e.reason}" for e in report.errors)
    return "\n".join(lines) + "\n"
