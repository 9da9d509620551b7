"""Small factories for wire records used across the collector tests."""

from __future__ import annotations

from vigil import schema

JOB = "job-a"


def step(
    rank: int,
    step: int,
    *,
    seconds: float = 0.5,
    wait: float = 0.1,
    job: str = JOB,
    mfu: float = 0.4,
) -> schema.StepRecord:
    start = 1_700_000_000.0 + step
    return schema.StepRecord(
        job_id=job,
        rank=rank,
        step=step,
        start_s=start,
        end_s=start + seconds,
        data_s=0.01,
        forward_s=0.1,
        backward_s=0.2,
        optimizer_s=0.05,
        comm_wait_s=wait,
        tokens=1000,
        mfu=mfu,
        loss=2.0,
    )


def steps(ranks: int, num_steps: int, *, job: str = JOB, first: int = 0) -> list[schema.StepRecord]:
    return [step(r, s, job=job) for s in range(first, first + num_steps) for r in range(ranks)]


def batch(records: list[schema.Record] | list[schema.StepRecord], batch_id: str) -> schema.Batch:
    return schema.Batch(v=schema.SCHEMA_VERSION, batch_id=batch_id, records=list(records))


def sample(
    node: str, time_s: float, value: float, *, metric: str = "gpu_util", device: str = "0"
) -> schema.Sample:
    return schema.Sample(node=node, time_s=time_s, metric=metric, value=value, device=device)
