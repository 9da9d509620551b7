"""Keep the part of each step's CPU wait that fell inside the watched model's forward passes.

`forward_cpu_wait_s` (seconds, Linux schedstat's runqueue time between the watched model's
forward pre-hook and forward hook, summed over the step's forward passes) is what the analyzer
takes out of a forward pass's growth when it compares a pipeline stage's forward time with its
own earlier steps (the step's whole CPU wait also holds waits outside the forward pass). Rows
stored before this revision, and senders that do not report it, hold 0 (unknown: the step's
`cpu_wait_s` serves instead). Self-contained: must not import vigil, whose layout may move on.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        batch.add_column(
            sa.Column("forward_cpu_wait_s", sa.Double(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        batch.drop_column("forward_cpu_wait_s")
