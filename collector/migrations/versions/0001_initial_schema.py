"""Initial schema of the collector store (the tables of vigil.collector.tables at 0.1).

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29 16:54:04.620304
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "actions",
        sa.Column("action_id", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("finding_id", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("start_s", sa.Double(), nullable=False),
        sa.Column("end_s", sa.Double(), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("action_id"),
    )
    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.create_index("ix_actions_job", ["job_id", "start_s"], unique=False)

    op.create_table(
        "batches",
        sa.Column("batch_id", sa.String(length=256), nullable=False),
        sa.Column("received_s", sa.Double(), nullable=False),
        sa.Column("num_records", sa.BigInteger(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("batch_id"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("location", sa.String(length=256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("save_s", sa.Double(), nullable=False),
        sa.Column("blocked_s", sa.Double(), nullable=False),
        sa.Column("verified", sa.Boolean(), nullable=False),
        sa.Column("committed_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "step", "location"),
    )
    op.create_table(
        "coll_aggs",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("group_name", sa.String(length=256), nullable=False),
        sa.Column("op", sa.String(length=256), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("total_device_s", sa.Double(), nullable=False),
        sa.Column("max_device_s", sa.Double(), nullable=False),
        sa.Column("total_wait_s", sa.Double(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "step", "rank", "group_name", "op"),
    )
    op.create_table(
        "coll_events",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("group_name", sa.String(length=256), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("op", sa.String(length=256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("dtype", sa.Text(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("enqueue_s", sa.Double(), nullable=False),
        sa.Column("start_s", sa.Double(), nullable=False),
        sa.Column("end_s", sa.Double(), nullable=False),
        sa.Column("received_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "rank", "group_name", "seq"),
    )
    with op.batch_alter_table("coll_events", schema=None) as batch_op:
        batch_op.create_index("ix_coll_events_job_step", ["job_id", "step"], unique=False)
        batch_op.create_index("ix_coll_events_received", ["received_s"], unique=False)

    op.create_table(
        "diag_results",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("node", sa.String(length=256), nullable=False),
        sa.Column("device", sa.Text(), nullable=False),
        sa.Column("test", sa.String(length=256), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("unit", sa.Text(), nullable=False),
        sa.Column("baseline", sa.Double(), nullable=True),
        sa.Column("spec", sa.Double(), nullable=True),
        sa.Column("verdict", sa.String(length=32), nullable=False),
        sa.Column("time_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("diag_results", schema=None) as batch_op:
        batch_op.create_index("ix_diag_results_node_time", ["node", "time_s"], unique=False)

    op.create_table(
        "findings",
        sa.Column("finding_id", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("subjects", sa.JSON(), nullable=False),
        sa.Column("step_start", sa.BigInteger(), nullable=False),
        sa.Column("step_end", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("confidence", sa.Double(), nullable=False),
        sa.Column("detected_s", sa.Double(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("trace_start_s", sa.Double(), nullable=False),
        sa.Column("trace_end_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("finding_id"),
    )
    with op.batch_alter_table("findings", schema=None) as batch_op:
        batch_op.create_index("ix_findings_job", ["job_id", "detected_s"], unique=False)

    op.create_table(
        "heartbeats",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("time_s", sa.Double(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("last_group", sa.Text(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_op", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("received_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("heartbeats", schema=None) as batch_op:
        batch_op.create_index(
            "ix_heartbeats_job_rank_time", ["job_id", "rank", "time_s"], unique=False
        )
        batch_op.create_index("ix_heartbeats_received", ["received_s"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("world_size", sa.BigInteger(), nullable=False),
        sa.Column("layout", sa.JSON(), nullable=False),
        sa.Column("model", sa.JSON(), nullable=True),
        sa.Column("device_kind", sa.Text(), nullable=False),
        sa.Column("peak_flops", sa.Double(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("created_s", sa.Double(), nullable=False),
        sa.Column("updated_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("job_id"),
    )
    op.create_table(
        "maintenance_state",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_table(
        "ranks",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("node", sa.String(length=256), nullable=False),
        sa.Column("local_rank", sa.BigInteger(), nullable=False),
        sa.Column("device_uuid", sa.Text(), nullable=False),
        sa.Column("pid", sa.BigInteger(), nullable=False),
        sa.Column("pod", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "rank"),
    )
    op.create_table(
        "sample_rollups",
        sa.Column("node", sa.String(length=256), nullable=False),
        sa.Column("device", sa.Text(), nullable=False),
        sa.Column("metric", sa.String(length=256), nullable=False),
        sa.Column("bucket_s", sa.Double(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("sum", sa.Double(), nullable=False),
        sa.Column("min", sa.Double(), nullable=False),
        sa.Column("max", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("node", "device", "metric", "bucket_s"),
    )
    op.create_table(
        "samples",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("node", sa.String(length=256), nullable=False),
        sa.Column("device", sa.Text(), nullable=False),
        sa.Column("metric", sa.String(length=256), nullable=False),
        sa.Column("time_s", sa.Double(), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("pod", sa.Text(), nullable=False),
        sa.Column("received_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.create_index("ix_samples_metric_time", ["metric", "time_s"], unique=False)
        batch_op.create_index("ix_samples_received", ["received_s"], unique=False)

    op.create_table(
        "step_matrix",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("step_time", sa.LargeBinary(), nullable=False),
        sa.Column("comm_wait", sa.LargeBinary(), nullable=False),
        sa.Column("mfu", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "step"),
    )
    op.create_table(
        "step_records",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=False),
        sa.Column("start_s", sa.Double(), nullable=False),
        sa.Column("end_s", sa.Double(), nullable=False),
        sa.Column("data_s", sa.Double(), nullable=False),
        sa.Column("forward_s", sa.Double(), nullable=False),
        sa.Column("backward_s", sa.Double(), nullable=False),
        sa.Column("optimizer_s", sa.Double(), nullable=False),
        sa.Column("comm_wait_s", sa.Double(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("model_flops", sa.Double(), nullable=False),
        sa.Column("mfu", sa.Double(), nullable=False),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "step", "rank"),
    )
    op.create_table(
        "traces",
        sa.Column("trace_id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("rank", sa.BigInteger(), nullable=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("uploaded_s", sa.Double(), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_events", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("trace_id"),
    )
    with op.batch_alter_table("traces", schema=None) as batch_op:
        batch_op.create_index("ix_traces_job", ["job_id", "uploaded_s"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("traces", schema=None) as batch_op:
        batch_op.drop_index("ix_traces_job")

    op.drop_table("traces")
    op.drop_table("step_records")
    op.drop_table("step_matrix")
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_index("ix_samples_received")
        batch_op.drop_index("ix_samples_metric_time")

    op.drop_table("samples")
    op.drop_table("sample_rollups")
    op.drop_table("ranks")
    op.drop_table("maintenance_state")
    op.drop_table("jobs")
    with op.batch_alter_table("heartbeats", schema=None) as batch_op:
        batch_op.drop_index("ix_heartbeats_received")
        batch_op.drop_index("ix_heartbeats_job_rank_time")

    op.drop_table("heartbeats")
    with op.batch_alter_table("findings", schema=None) as batch_op:
        batch_op.drop_index("ix_findings_job")

    op.drop_table("findings")
    with op.batch_alter_table("diag_results", schema=None) as batch_op:
        batch_op.drop_index("ix_diag_results_node_time")

    op.drop_table("diag_results")
    with op.batch_alter_table("coll_events", schema=None) as batch_op:
        batch_op.drop_index("ix_coll_events_received")
        batch_op.drop_index("ix_coll_events_job_step")

    op.drop_table("coll_events")
    op.drop_table("coll_aggs")
    op.drop_table("checkpoints")
    op.drop_table("batches")
    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.drop_index("ix_actions_job")

    op.drop_table("actions")
