"""Response shapes of the query API (`*Public`), documented in the OpenAPI spec.

Handlers encode their plain-dict results with msgspec for speed; these pydantic models describe
those bodies for the docs and for schema-driven tests. Non-finite numbers are sent as null.
Must not hold logic.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class ErrorPublic(BaseModel):
    detail: str


class IngestPublic(BaseModel):
    batch_id: str
    accepted: int
    duplicate: bool


class FrameResultPublic(BaseModel):
    """One frame's answer: the status a lone POST of it would have had, and that POST's body
    (batch_id, accepted, duplicate on 200; detail otherwise)."""

    status: int
    batch_id: str | None = None
    accepted: int | None = None
    duplicate: bool | None = None
    detail: str | None = None


class FramesPublic(BaseModel):
    results: list[FrameResultPublic]


class JobPublic(BaseModel):
    job_id: str
    name: str
    world_size: int
    layout: dict[str, int]
    model: dict[str, int] | None
    device_kind: str
    peak_flops: float | None
    state: str
    created_s: float | None
    updated_s: float | None


class RankStatePublic(BaseModel):
    rank: int
    time_s: float | None
    state: str
    last_step: int
    last_group: str
    last_seq: int
    last_op: str
    silent_s: float | None


class JobStatePublic(BaseModel):
    job_id: str
    state: str
    world_size: int | None
    last_step: int | None
    last_step_end_s: float | None
    num_ranks_reporting: int
    open_findings: int
    ranks: list[RankStatePublic]


class RankPublic(BaseModel):
    job_id: str
    rank: int
    node: str
    local_rank: int
    device_uuid: str
    pid: int
    pod: str


class StepPublic(BaseModel):
    job_id: str
    step: int
    rank: int
    start_s: float | None
    end_s: float | None
    data_s: float | None
    forward_s: float | None
    backward_s: float | None
    optimizer_s: float | None
    comm_wait_s: float | None
    tokens: int
    model_flops: float | None
    mfu: float | None
    loss: float | None
    peak_memory_bytes: int
    cpu_wait_s: float | None = None
    forward_cpu_wait_s: float | None = None
    pipeline_s: float | None = None
    pipeline_cpu_wait_s: float | None = None
    pipeline_comm_wait_s: float | None = None
    stage_backward_s: float | None = None
    stage_backward_wait_s: float | None = None


class RankAggregatePublic(BaseModel):
    rank: int
    num_steps: int
    mean_step_time_s: float | None
    max_step_time_s: float | None
    mean_compute_s: float | None
    mean_comm_wait_s: float | None
    mean_data_s: float | None
    mean_mfu: float | None
    tokens: int


class HeatmapPublic(BaseModel):
    """`values[i][r]` is rank `ranks[r]` over steps `steps[i]` .. `steps[i] + stride - 1` (the
    mean of the steps it reported, null if none); `ranks` are the ranks with at least one value
    in the range, sorted."""

    job_id: str
    metric: str
    stride: int
    ranks: list[int]
    steps: list[int]
    values: list[list[float | None]]


class CollectivePublic(BaseModel):
    group: str
    op: str
    rank: int | None = None
    count: int
    bytes: int
    total_device_s: float | None
    max_device_s: float | None
    total_wait_s: float | None
    num_steps: int


class SamplePointPublic(BaseModel):
    time_s: float | None
    mean: float | None
    min: float | None
    max: float | None
    count: int


class SampleSeriesPublic(BaseModel):
    node: str
    device: str
    points: list[SamplePointPublic]


class SamplesPublic(BaseModel):
    metric: str
    start_s: float | None
    end_s: float | None
    bucket_s: float | None
    source: str
    series: list[SampleSeriesPublic]


class FindingPublic(BaseModel):
    finding_id: str
    kind: str
    job_id: str
    subjects: dict[str, list[Any]]
    step_start: int
    step_end: int
    summary: str
    evidence: list[dict[str, Any]]
    confidence: float | None
    detected_s: float | None
    state: str
    trace_start_s: float | None
    trace_end_s: float | None


class ActionPublic(BaseModel):
    action_id: str
    kind: str
    job_id: str
    target: str
    finding_id: str
    state: str
    start_s: float | None
    end_s: float | None
    result: str
    # The restart record (restart actions): the attempt it launched (0 = first start), the first
    # step that attempt trained, the steps trained again, and when its first step was seen
    # (time to recover of a finding = recovered_s - the finding's detected_s); -1 / null unknown.
    attempt: int
    resume_step: int
    steps_lost: int
    recovered_s: float | None  # 0: not recovered yet


class CheckpointPublic(BaseModel):
    job_id: str
    step: int
    location: str
    bytes: int
    save_s: float | None
    blocked_s: float | None
    verified: bool
    committed_s: float | None


class DiagResultPublic(BaseModel):
    node: str
    device: str
    test: str
    value: float | None
    unit: str
    baseline: float | None
    spec: float | None
    verdict: str
    time_s: float | None


class TraceInfoPublic(BaseModel):
    trace_id: str
    job_id: str
    rank: int | None
    name: str
    uploaded_s: float
    num_bytes: int
    num_events: int


class ChromeTracePublic(BaseModel):
    """Chrome trace-event format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU"""

    traceEvents: list[dict[str, Any]]  # noqa: N815 (the format's own key)
    displayTimeUnit: str  # noqa: N815
    otherData: dict[str, Any]  # noqa: N815


class ControlIn(BaseModel):
    """A control request for a job's running ranks (`POST /api/v1/jobs/{job}/control`)."""

    model_config = {"extra": "forbid"}

    kind: Literal["checkpoint", "dump_stacks"]
    # The ranks to ask, or "all" (every rank the job reported).
    ranks: list[Annotated[int, Field(ge=0, lt=2**31)]] | Literal["all"] = "all"
    # The request's id (idempotent: the same id again answers the stored request); default new.
    id: (
        Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")] | None
    ) = None


class ControlAckIn(BaseModel):
    """A node agent's report of the ranks whose SDK acknowledged a control request."""

    model_config = {"extra": "forbid"}

    node: Annotated[str, Field(min_length=1, max_length=256)]
    ranks: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=1, max_length=65_536)
    # What a rank answered with, by rank (a dump_stacks request: its stacks; at most 64 KiB each).
    details: dict[int, Annotated[str, Field(max_length=65_536)]] = Field(default_factory=dict)


class ControlPublic(BaseModel):
    """A control request and where its acknowledgements stand."""

    id: str
    job_id: str
    kind: str
    ranks: list[int] | None  # null: every rank of the job
    created_s: float
    expected: list[int]  # the ranks that must acknowledge (the job's known ranks for "all")
    acked: list[int]
    done: bool
    # Each acknowledging rank's answer (with ?details=true only).
    details: dict[int, str] | None = None


class PendingControlPublic(BaseModel):
    """A control request for a node agent: the ranks on its node still to acknowledge."""

    id: str
    job_id: str
    kind: str
    ranks: list[int]
    created_s: float


class ApprovalPublic(BaseModel):
    """An action as `advise` mode's approvals see it."""

    action_id: str
    job_id: str
    kind: str
    target: str
    state: str  # proposed -> approved (by a person), then the controller's own states
    result: str
