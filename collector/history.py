"""A job's recent past read back from the store, for a streaming analyzer that starts late.

After a collector restart the analyzer has no state; a running job may never resend its Job record,
and a hung job sends only heartbeats. `recent(store, job_id, steps)` gives what the analyzer needs
to pick the job up where it was: its Job and RankInfo records, and its last `steps` steps' step
records (as columns) and collective aggregates. Read-only.
"""

from __future__ import annotations

import msgspec
from sqlalchemy import func, select

from vigil import columns, schema
from vigil.collector import step_matrix, tables
from vigil.collector.store import Store

# Aggregates of the last steps of a 10,000-rank job with a few groups: bounded, not unbounded.
_MAX_AGG_ROWS = 200_000


def recent(
    store: Store, job_id: str, steps: int
) -> tuple[list[schema.Record], columns.StepColumns | None]:
    """The job's description and its last `steps` steps, as records and step columns."""
    records: list[schema.Record] = []
    s, a = tables.step_records, tables.coll_aggs
    with store.read() as conn:
        job = conn.execute(select(tables.jobs).where(tables.jobs.c.job_id == job_id)).first()
        if job is not None and job.world_size:
            records.append(
                schema.Job(
                    job_id=job_id,
                    name=job.name,
                    world_size=job.world_size,
                    layout=msgspec.convert(job.layout or {}, schema.ParallelLayout),
                    device_kind=job.device_kind,
                    peak_flops=job.peak_flops,
                    state=schema.JobState(job.state),
                    created_s=job.created_s,
                )
            )
        r = tables.ranks
        for row in conn.execute(select(r).where(r.c.job_id == job_id)).mappings():
            records.append(schema.RankInfo(**dict(row)))
        last = conn.execute(select(func.max(s.c.step)).where(s.c.job_id == job_id)).scalar()
        if last is None:
            return records, None
        first = max(0, int(last) - steps + 1)
        picked = [s.c[name] for name in step_matrix.STEP_COLUMNS]
        rows = conn.execute(
            select(*picked).where(s.c.job_id == job_id, s.c.step >= first).order_by(s.c.step)
        ).all()
        agg_rows = conn.execute(
            select(*(a.c[name] for name in step_matrix.struct_columns(schema.CollectiveAggregate)))
            .where(a.c.job_id == job_id, a.c.step >= first)
            .order_by(a.c.step)
            .limit(_MAX_AGG_ROWS)
        ).all()
    fields = schema.CollectiveAggregate.__struct_fields__
    records.extend(
        schema.CollectiveAggregate(**dict(zip(fields, row, strict=True))) for row in agg_rows
    )
    return records, columns.from_rows([tuple(row) for row in rows]) if rows else None
