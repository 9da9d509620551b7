"""Keep each step's time inside pipeline schedules, and the waits in there.

`pipeline_s` (seconds the training thread spent inside a `torch.distributed.pipelining`
schedule's `step` during the step), `pipeline_cpu_wait_s` (Linux schedstat's runqueue time in
there) and `pipeline_comm_wait_s` (its time blocked in collectives in there). A pipeline stage
waits for its peers inside its schedule, so the analyzer compares a stage's time outside it,
less its waits there, with the stage's own earlier steps. Rows stored before this
revision, and senders that do not report them, hold 0 (no pipeline timed). Self-contained: must
not import vigil, whose layout may move on.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        batch.add_column(sa.Column("pipeline_s", sa.Double(), nullable=False, server_default="0"))
        for name in ("pipeline_cpu_wait_s", "pipeline_comm_wait_s"):
            batch.add_column(sa.Column(name, sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        batch.drop_column("pipeline_comm_wait_s")
        batch.drop_column("pipeline_cpu_wait_s")
        batch.drop_column("pipeline_s")
