"""The wire contract: every record vigil's parts exchange, as versioned msgspec Structs.

These types are shared by the SDK, the node agent, the collector, the analyzer and the recovery
controller. They hold data only: no I/O, no imports of other vigil packages. Times are seconds:
`*_s` fields ending a wall-clock instant are Unix seconds (float); durations are seconds too.

Compatibility rule: SCHEMA_VERSION is bumped when a field is removed, renamed or changes meaning,
or when old decoders would silently ignore data (v2 added `Batch.steps`, the columnar step block).
Adding an optional field (with a default) keeps the version; old decoders ignore unknown fields.
Decoders accept every version in SUPPORTED_VERSIONS, so collectors are upgraded before agents.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

SCHEMA_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, 2})

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Every string and list on the wire is bounded (decoders refuse longer ones before building
# them), so a record's size on the wire bounds what it costs to decode and store.
Text = Annotated[str, msgspec.Meta(max_length=256)]
LongText = Annotated[str, msgspec.Meta(max_length=4096)]
MAX_SUBJECTS = 4096  # ranks, nodes, devices or links one finding names
MAX_EVIDENCE = 64  # evidence entries of one finding
MAX_STEP_FIELDS = 64  # columns of a step block
MAX_BLOCK_JOBS = 4096  # distinct jobs of one step block


class JobState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    RECOVERING = "recovering"
    COMPLETED = "completed"
    FAILED = "failed"


class RankState(enum.StrEnum):
    STARTING = "starting"
    COMPUTE = "compute"
    IN_COLLECTIVE = "in_collective"
    DATA = "data"
    CHECKPOINTING = "checkpointing"
    FINISHED = "finished"
    FAILED = "failed"
    # Stopped from outside: by SIGTERM (a launcher stopping the job, an eviction, a preemption),
    # the process's last word before the signal's default action ended it; or by Ctrl-C
    # (SIGINT: a KeyboardInterrupt, or an error once SIGINT came).
    TERMINATED = "terminated"


class FindingKind(enum.StrEnum):
    STRAGGLER = "straggler"
    HANG = "hang"
    MFU_DROP = "mfu_drop"
    SLOW_LINK = "slow_link"
    NODE_FAULT = "node_fault"
    SDC = "sdc"
    DATA_STALL = "data_stall"
    STAGE_IMBALANCE = "stage_imbalance"
    SEQLEN_IMBALANCE = "seqlen_imbalance"
    CRASH = "crash"
    # The recovery controller will not restart this job: its own configuration lacks what a
    # safe restart needs (evidence: each missing precondition, e.g. a JobSet's podFailurePolicy).
    # A vocabulary addition, SCHEMA_VERSION kept: collectors are upgraded before controllers.
    RECOVERY_UNSAFE = "recovery_unsafe"


class FindingState(enum.StrEnum):
    OPEN = "open"
    ACKNOWLEDGED = "acknowledged"
    RESOLVED = "resolved"


class ActionKind(enum.StrEnum):
    CHECKPOINT = "checkpoint"
    DUMP_STACKS = "dump_stacks"
    DIAGNOSE = "diagnose"
    CORDON = "cordon"
    RESTART = "restart"
    MIGRATE = "migrate"
    RESIZE = "resize"


class ActionState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    # `advise` mode: a change the controller proposes, waiting for a person's approval
    # (`POST /api/v1/actions/{id}/approve`), then approved.
    PROPOSED = "proposed"
    APPROVED = "approved"


class Verdict(enum.StrEnum):
    PASS = "pass"
    SUSPECT = "suspect"
    FAIL = "fail"
    UNKNOWN = "unknown"


class _Record(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=True):
    """Base of every wire record; the `type` tag names the record on the wire."""


class ParallelLayout(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sizes of each parallel dimension; their product is the world size."""

    dp: Annotated[int, msgspec.Meta(ge=1)] = 1
    tp: Annotated[int, msgspec.Meta(ge=1)] = 1
    pp: Annotated[int, msgspec.Meta(ge=1)] = 1
    cp: Annotated[int, msgspec.Meta(ge=1)] = 1
    ep: Annotated[int, msgspec.Meta(ge=1)] = 1

    @property
    def world_size(self) -> int:
        # Expert parallelism reuses data-parallel ranks, so it does not multiply the world size.
        return self.dp * self.tp * self.pp * self.cp


class ModelShape(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What MFU accounting (`vigil.flops`) needs: N, layers L, hidden size, heads, seq length T.

    `params` is N: every parameter except the input embedding table(s); the output head counts.
    `hidden` is heads · head dim (PaLM's H·Q).
    """

    params: NonNegInt
    layers: NonNegInt = 0
    hidden: NonNegInt = 0
    heads: NonNegInt = 0
    seq_len: NonNegInt = 0


class Job(_Record, tag="job", kw_only=True):
    job_id: Name
    name: Text = ""
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    layout: ParallelLayout = msgspec.field(default_factory=ParallelLayout)
    model: ModelShape | None = None
    device_kind: Text = ""
    peak_flops: NonNegFloat = 0.0
    state: JobState = JobState.RUNNING
    created_s: NonNegFloat = 0.0


class RankInfo(_Record, tag="rank", kw_only=True):
    job_id: Name
    rank: NonNegInt
    node: Name
    local_rank: NonNegInt = 0
    device_uuid: Text = ""
    pid: NonNegInt = 0
    pod: Text = ""
    # The job's world size as this rank sees it (0: unknown, older senders): every rank sends
    # it, so a streaming analyzer knows how many ranks to wait for before rank 0's Job arrives.
    world_size: NonNegInt = 0


class StepRecord(_Record, tag="step", kw_only=True):
    """One training step of one rank; phase durations are seconds."""

    job_id: Name
    rank: NonNegInt
    step: NonNegInt
    start_s: NonNegFloat
    end_s: NonNegFloat
    data_s: NonNegFloat = 0.0
    forward_s: NonNegFloat = 0.0
    backward_s: NonNegFloat = 0.0
    optimizer_s: NonNegFloat = 0.0
    comm_wait_s: NonNegFloat = 0.0
    tokens: NonNegInt = 0
    model_flops: NonNegFloat = 0.0
    mfu: NonNegFloat = 0.0
    loss: float | None = None
    peak_memory_bytes: NonNegInt = 0
    # Of the step's time, how long the training thread was ready to run but waited for a CPU
    # (Linux schedstat; 0 where unknown): the host's, not the rank's own work.
    cpu_wait_s: NonNegFloat = 0.0
    # Of that wait, the part inside the watched model's forward passes (their module hooks; 0
    # where unknown: no watched forward ran, or a "forward" span timed part of it).
    forward_cpu_wait_s: NonNegFloat = 0.0
    # Of the step's time, how long the training thread was inside a pipeline schedule's `step`
    # (torch.distributed.pipelining; 0 where none ran), its CPU wait in there, and its time
    # blocked in collectives in there: a stage waits for its peers inside, so its time outside,
    # less its waits there, is its own.
    pipeline_s: NonNegFloat = 0.0
    pipeline_cpu_wait_s: NonNegFloat = 0.0
    pipeline_comm_wait_s: NonNegFloat = 0.0  # ... and its time blocked in collectives in there
    # Of the time inside, how long the stage's backward passes took (their chunks' calls:
    # `_PipelineStageBase.backward_one_chunk`, `backward_weight_one_chunk`; 0 where none was
    # timed), and of that its wait for a CPU and time blocked in collectives: the schedule
    # receives a chunk's gradients before its backward runs, so the rest is the stage's own.
    stage_backward_s: NonNegFloat = 0.0
    stage_backward_wait_s: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        if self.end_s < self.start_s:
            raise ValueError(f"end_s ({self.end_s}) is before start_s ({self.start_s})")

    @property
    def step_time_s(self) -> float:
        return self.end_s - self.start_s


class CollectiveAggregate(_Record, tag="coll_agg", kw_only=True):
    """Per (step, rank, group, op): how many collectives ran and how long they took.

    `last_device_s` is the duration of the op with the highest sequence number (`last_seq`);
    `overlapped` says the ops ran behind compute and the training thread waited for them where
    the SDK cannot see (DDP's gradient buckets): the analyzer takes their exposed wait from the
    last op's duration across ranks instead of the sum (docs/architecture.md, "Attribution").
    """

    job_id: Name
    rank: NonNegInt
    step: NonNegInt
    group: Name
    op: Name
    count: NonNegInt
    bytes: NonNegInt = 0
    total_device_s: NonNegFloat = 0.0
    max_device_s: NonNegFloat = 0.0
    total_wait_s: NonNegFloat = 0.0
    last_seq: NonNegInt = 0
    last_device_s: NonNegFloat = 0.0
    overlapped: bool = False


class CollectiveEvent(_Record, tag="coll_event", kw_only=True):
    """One collective as seen by one rank (ring buffer; shipped on demand)."""

    job_id: Name
    rank: NonNegInt
    group: Name
    seq: NonNegInt
    op: Name
    bytes: NonNegInt = 0
    dtype: Text = ""
    step: NonNegInt = 0
    enqueue_s: NonNegFloat = 0.0
    start_s: NonNegFloat = 0.0
    end_s: NonNegFloat = 0.0


class Heartbeat(_Record, tag="heartbeat", kw_only=True):
    job_id: Name
    rank: NonNegInt
    time_s: NonNegFloat
    last_step: int = -1
    last_group: Text = ""
    last_seq: NonNegInt = 0
    last_op: Text = ""
    state: RankState = RankState.COMPUTE
    # Checkpoint spans the rank has finished (0: none, or a sender without the field): a rank
    # still checkpointing while a peer has finished more saves is behind that peer.
    checkpoints: NonNegInt = 0
    # Between steps: the training thread ended a step and has not begun the next (user code
    # the SDK does not time: an evaluation, a save only this rank makes); False from senders
    # without the field. The hang tracker gives such silence the start-up grace.
    between_steps: bool = False
    # torch.compile is compiling in the rank's process (a recompilation mid-run: seconds to
    # minutes inside a step); False from senders without the field. The start-up grace too.
    compiling: bool = False


class Sample(_Record, tag="sample", kw_only=True):
    """One counter reading from NVML or the host; `device` is empty for host metrics."""

    node: Name
    time_s: NonNegFloat
    metric: Name
    value: float
    device: Text = ""
    job_id: Text = ""
    rank: int = -1
    pod: Text = ""


class Subjects(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Who a finding is about. Links are "nodeA<->nodeB" strings."""

    ranks: Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_SUBJECTS)] = msgspec.field(
        default_factory=list
    )
    nodes: Annotated[list[Text], msgspec.Meta(max_length=MAX_SUBJECTS)] = msgspec.field(
        default_factory=list
    )
    devices: Annotated[list[Text], msgspec.Meta(max_length=MAX_SUBJECTS)] = msgspec.field(
        default_factory=list
    )
    links: Annotated[list[Text], msgspec.Meta(max_length=MAX_SUBJECTS)] = msgspec.field(
        default_factory=list
    )


class Evidence(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A number that moved: the metric, its observed value, its baseline and the unit."""

    metric: Name
    observed: float
    baseline: float | None = None
    unit: Text = ""
    note: LongText = ""


class Finding(_Record, tag="finding", kw_only=True):
    finding_id: Name
    kind: FindingKind
    job_id: Name
    subjects: Subjects = msgspec.field(default_factory=Subjects)
    step_start: int = -1
    step_end: int = -1
    summary: LongText = ""
    evidence: Annotated[list[Evidence], msgspec.Meta(max_length=MAX_EVIDENCE)] = msgspec.field(
        default_factory=list
    )
    confidence: Fraction = 0.0
    detected_s: NonNegFloat = 0.0
    state: FindingState = FindingState.OPEN
    trace_start_s: NonNegFloat = 0.0
    trace_end_s: NonNegFloat = 0.0


class Action(_Record, tag="action", kw_only=True):
    action_id: Name
    kind: ActionKind
    job_id: Name
    target: Text = ""
    finding_id: Text = ""
    state: ActionState = ActionState.PENDING
    start_s: NonNegFloat = 0.0
    end_s: NonNegFloat = 0.0
    result: LongText = ""
    # The restart record (restart actions; -1 / 0 where not known or not a restart). A restart is
    # posted when it relaunches, then again under the same id once the new attempt's first step
    # is seen: time to recover of a finding = recovered_s - its detected_s.
    attempt: Annotated[int, msgspec.Meta(ge=-1)] = -1  # attempt launched (0 = first start)
    resume_step: Annotated[int, msgspec.Meta(ge=-1)] = -1  # first step trained again
    steps_lost: Annotated[int, msgspec.Meta(ge=-1)] = -1  # steps trained twice
    recovered_s: NonNegFloat = 0.0  # when the new attempt's first step was seen


class Checkpoint(_Record, tag="checkpoint", kw_only=True):
    job_id: Name
    step: NonNegInt
    location: Name
    bytes: NonNegInt = 0
    save_s: NonNegFloat = 0.0
    blocked_s: NonNegFloat = 0.0
    verified: bool = False
    committed_s: NonNegFloat = 0.0


class DiagResult(_Record, tag="diag", kw_only=True):
    node: Name
    device: Text
    test: Name
    value: float
    unit: Text = ""
    baseline: float | None = None
    spec: float | None = None
    verdict: Verdict = Verdict.UNKNOWN
    time_s: NonNegFloat = 0.0


Record = (
    Job
    | RankInfo
    | StepRecord
    | CollectiveAggregate
    | CollectiveEvent
    | Heartbeat
    | Sample
    | Finding
    | Action
    | Checkpoint
    | DiagResult
)

RECORD_TYPES: tuple[type[_Record], ...] = (
    Job,
    RankInfo,
    StepRecord,
    CollectiveAggregate,
    CollectiveEvent,
    Heartbeat,
    Sample,
    Finding,
    Action,
    Checkpoint,
    DiagResult,
)

RECORD_TAGS: dict[str, type[_Record]] = {str(t.__struct_config__.tag): t for t in RECORD_TYPES}


class StepBlock(msgspec.Struct, kw_only=True):
    """A batch's step records as columns (schema v2): decoding one map per record costs the
    collector more than storing it, decoding packed arrays costs nothing. `vigil.columns` packs
    and checks it. Record i: job `job_ids[jobs[i]]`; `values[i, j]` field `fields[j]` (a
    StepRecord field other than job_id and loss; integer fields are whole numbers below 2**53);
    `loss[i]` its loss, NaN where unknown. `jobs` is little-endian uint32, `values` row-major and
    `loss` little-endian float64; `loss` may be empty (all unknown)."""

    fields: Annotated[list[Text], msgspec.Meta(max_length=MAX_STEP_FIELDS)]
    job_ids: Annotated[list[Name], msgspec.Meta(max_length=MAX_BLOCK_JOBS)]
    jobs: bytes
    values: bytes
    loss: bytes = b""


class Batch(msgspec.Struct, kw_only=True):
    """The envelope every shipment travels in; `batch_id` makes retries idempotent. `steps`:
    step records packed as columns (v2 senders put them there rather than in `records`)."""

    v: int
    batch_id: Name
    sent_s: NonNegFloat = 0.0
    source: Text = ""
    records: list[Record] = msgspec.field(default_factory=list)
    steps: StepBlock | None = None
