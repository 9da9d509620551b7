"""The collector's relational schema as SQLAlchemy Core tables (one `MetaData`).

Alembic migrations in `migrations/versions` create exactly these tables; a test compares the two.
Column names follow the wire records in `vigil.schema`. Portable across SQLite and PostgreSQL:
no dialect-only types. Must not open connections.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Double,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    false,
)

metadata = MetaData()

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL wants BIGINT for big tables.
RowId = BigInteger().with_variant(Integer(), "sqlite")
NAME = 256


def _name(column: str, *, primary_key: bool = False) -> Column[str]:
    return Column(column, String(NAME), primary_key=primary_key, nullable=False)


batches = Table(
    "batches",
    metadata,
    _name("batch_id", primary_key=True),
    Column("received_s", Double, nullable=False),
    Column("num_records", BigInteger, nullable=False),
    Column("source", Text, nullable=False, default=""),
)

jobs = Table(
    "jobs",
    metadata,
    _name("job_id", primary_key=True),
    Column("name", Text, nullable=False),
    Column("world_size", BigInteger, nullable=False),
    Column("layout", JSON, nullable=False),
    Column("model", JSON, nullable=True),
    Column("device_kind", Text, nullable=False),
    Column("peak_flops", Double, nullable=False),
    Column("state", String(32), nullable=False),
    Column("created_s", Double, nullable=False),
    Column("updated_s", Double, nullable=False),
)

ranks = Table(
    "ranks",
    metadata,
    _name("job_id", primary_key=True),
    Column("rank", BigInteger, primary_key=True),
    Column("node", String(NAME), nullable=False),
    Column("local_rank", BigInteger, nullable=False),
    Column("device_uuid", Text, nullable=False),
    Column("pid", BigInteger, nullable=False),
    Column("pod", Text, nullable=False),
    Column("world_size", BigInteger, nullable=False, server_default="0"),
)

# Keyed (job, step, rank): a step re-run after a restart replaces the earlier attempt.
step_records = Table(
    "step_records",
    metadata,
    _name("job_id", primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("rank", BigInteger, primary_key=True),
    Column("start_s", Double, nullable=False),
    Column("end_s", Double, nullable=False),
    Column("data_s", Double, nullable=False),
    Column("forward_s", Double, nullable=False),
    Column("backward_s", Double, nullable=False),
    Column("optimizer_s", Double, nullable=False),
    Column("comm_wait_s", Double, nullable=False),
    Column("tokens", BigInteger, nullable=False),
    Column("model_flops", Double, nullable=False),
    Column("mfu", Double, nullable=False),
    Column("loss", Double, nullable=True),
    Column("peak_memory_bytes", BigInteger, nullable=False),
    # Added by revision 0007: the training thread's wait for a CPU (0 in older rows).
    Column("cpu_wait_s", Double, nullable=False, server_default="0"),
    # Added by revision 0008: the part of that wait inside forward passes (0: unknown).
    Column("forward_cpu_wait_s", Double, nullable=False, server_default="0"),
    # Added by revision 0009: time inside pipeline schedules, and the CPU and collective waits
    # there (0: none).
    Column("pipeline_s", Double, nullable=False, server_default="0"),
    Column("pipeline_cpu_wait_s", Double, nullable=False, server_default="0"),
    Column("pipeline_comm_wait_s", Double, nullable=False, server_default="0"),
    # Added by revision 0010: time in a pipeline stage's backward passes, and the CPU and
    # collective waits there (0: none).
    Column("stage_backward_s", Double, nullable=False, server_default="0"),
    Column("stage_backward_wait_s", Double, nullable=False, server_default="0"),
)

# Rank-major columns of one step's chunk of 1,024 ranks (little-endian float64 arrays indexed by
# rank % 1024, NaN = missing; chunk = rank // 1024, a row only where one of its ranks reported):
# the layout a rank x step heatmap reads without touching a million rows.
step_matrix = Table(
    "step_matrix",
    metadata,
    _name("job_id", primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("chunk", Integer, primary_key=True, autoincrement=False),
    Column("step_time", LargeBinary, nullable=False),
    Column("comm_wait", LargeBinary, nullable=False),
    Column("mfu", LargeBinary, nullable=False),
)

coll_aggs = Table(
    "coll_aggs",
    metadata,
    _name("job_id", primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("rank", BigInteger, primary_key=True),
    _name("group_name", primary_key=True),
    _name("op", primary_key=True),
    Column("count", BigInteger, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("total_device_s", Double, nullable=False),
    Column("max_device_s", Double, nullable=False),
    Column("total_wait_s", Double, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    Column("last_device_s", Double, nullable=False, server_default="0"),
    Column("overlapped", Boolean, nullable=False, server_default=false()),
)

coll_events = Table(
    "coll_events",
    metadata,
    _name("job_id", primary_key=True),
    Column("rank", BigInteger, primary_key=True),
    _name("group_name", primary_key=True),
    Column("seq", BigInteger, primary_key=True),
    _name("op"),
    Column("bytes", BigInteger, nullable=False),
    Column("dtype", Text, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("enqueue_s", Double, nullable=False),
    Column("start_s", Double, nullable=False),
    Column("end_s", Double, nullable=False),
    Column("received_s", Double, nullable=False),
    Index("ix_coll_events_job_step", "job_id", "step"),
    Index("ix_coll_events_received", "received_s"),
)

heartbeats = Table(
    "heartbeats",
    metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    _name("job_id"),
    Column("rank", BigInteger, nullable=False),
    Column("time_s", Double, nullable=False),
    Column("last_step", BigInteger, nullable=False),
    Column("last_group", Text, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    Column("last_op", Text, nullable=False),
    Column("state", String(32), nullable=False),
    Column("received_s", Double, nullable=False),
    Index("ix_heartbeats_job_rank_time", "job_id", "rank", "time_s"),
    Index("ix_heartbeats_received", "received_s"),
)

samples = Table(
    "samples",
    metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    _name("node"),
    Column("device", Text, nullable=False),
    _name("metric"),
    Column("time_s", Double, nullable=False),
    Column("value", Double, nullable=False),
    Column("job_id", Text, nullable=False),
    Column("rank", BigInteger, nullable=False),
    Column("pod", Text, nullable=False),
    Column("received_s", Double, nullable=False),
    Index("ix_samples_metric_time", "metric", "time_s"),
    Index("ix_samples_received", "received_s"),
)

# One row per (series, bucket): count/sum/min/max of every raw sample, kept after raw expiry.
sample_rollups = Table(
    "sample_rollups",
    metadata,
    _name("node", primary_key=True),
    Column("device", Text, primary_key=True),
    _name("metric", primary_key=True),
    Column("bucket_s", Double, primary_key=True),
    Column("count", BigInteger, nullable=False),
    Column("sum", Double, nullable=False),
    Column("min", Double, nullable=False),
    Column("max", Double, nullable=False),
)

findings = Table(
    "findings",
    metadata,
    _name("finding_id", primary_key=True),
    Column("kind", String(32), nullable=False),
    _name("job_id"),
    Column("subjects", JSON, nullable=False),
    Column("step_start", BigInteger, nullable=False),
    Column("step_end", BigInteger, nullable=False),
    Column("summary", Text, nullable=False),
    Column("evidence", JSON, nullable=False),
    Column("confidence", Double, nullable=False),
    Column("detected_s", Double, nullable=False),
    Column("state", String(32), nullable=False),
    Column("trace_start_s", Double, nullable=False),
    Column("trace_end_s", Double, nullable=False),
    Index("ix_findings_job", "job_id", "detected_s"),
)

actions = Table(
    "actions",
    metadata,
    _name("action_id", primary_key=True),
    Column("kind", String(32), nullable=False),
    _name("job_id"),
    Column("target", Text, nullable=False),
    Column("finding_id", Text, nullable=False),
    Column("state", String(32), nullable=False),
    Column("start_s", Double, nullable=False),
    Column("end_s", Double, nullable=False),
    Column("result", Text, nullable=False),
    # The restart record (revision 0005): -1 / 0 where unknown or not a restart.
    Column("attempt", BigInteger, nullable=False, server_default="-1"),
    Column("resume_step", BigInteger, nullable=False, server_default="-1"),
    Column("steps_lost", BigInteger, nullable=False, server_default="-1"),
    Column("recovered_s", Double, nullable=False, server_default="0"),
    Index("ix_actions_job", "job_id", "start_s"),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    _name("job_id", primary_key=True),
    Column("step", BigInteger, primary_key=True),
    _name("location", primary_key=True),
    Column("bytes", BigInteger, nullable=False),
    Column("save_s", Double, nullable=False),
    Column("blocked_s", Double, nullable=False),
    Column("verified", Boolean, nullable=False),
    Column("committed_s", Double, nullable=False),
)

diag_results = Table(
    "diag_results",
    metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    _name("node"),
    Column("device", Text, nullable=False),
    _name("test"),
    Column("value", Double, nullable=False),
    Column("unit", Text, nullable=False),
    Column("baseline", Double, nullable=True),
    Column("spec", Double, nullable=True),
    Column("verdict", String(32), nullable=False),
    Column("time_s", Double, nullable=False),
    Index("ix_diag_results_node_time", "node", "time_s"),
)

# Uploaded Kineto traces, zstd-compressed, for offline analysis.
traces = Table(
    "traces",
    metadata,
    Column("trace_id", String(64), primary_key=True),
    _name("job_id"),
    Column("rank", BigInteger, nullable=True),
    Column("name", Text, nullable=False),
    Column("uploaded_s", Double, nullable=False),
    Column("num_bytes", BigInteger, nullable=False),
    Column("num_events", BigInteger, nullable=False),
    Column("content", LargeBinary, nullable=False),
    Index("ix_traces_job", "job_id", "uploaded_s"),
)

# Control requests for running ranks (checkpoint now, dump stacks), revision 0006: posted by the
# recovery controller, fetched by the node agents of the nodes the job's ranks run on, which
# write them into the ranks' progress pages and post each rank's acknowledgement back.
control_requests = Table(
    "control_requests",
    metadata,
    _name("request_id", primary_key=True),
    _name("job_id"),
    Column("kind", String(32), nullable=False),
    Column("ranks", JSON, nullable=True),  # null: every rank of the job
    Column("created_s", Double, nullable=False),
    Index("ix_control_requests_job", "job_id", "created_s"),
)

control_acks = Table(
    "control_acks",
    metadata,
    _name("request_id", primary_key=True),
    Column("rank", BigInteger, primary_key=True),
    _name("node"),
    Column("acked_s", Double, nullable=False),
    # What the rank answered with (a dump_stacks request: its stacks), "" when nothing.
    Column("detail", Text, nullable=False, server_default=""),
)

# Small key/value state of background maintenance (the rollup watermark).
maintenance_state = Table(
    "maintenance_state",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Double, nullable=False),
)
