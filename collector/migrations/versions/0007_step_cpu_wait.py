"""Keep each step record's CPU wait: how long the training thread waited for a CPU.

`cpu_wait_s` (seconds, Linux schedstat's runqueue time over the step) is what the analyzer
leaves out of a rank's compute: the host's time, not the rank's work. Rows stored before this
revision, and senders that do not report it, hold 0 (unknown: nothing is left out).
Self-contained: must not import vigil, whose layout may move on.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 04:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        batch.add_column(sa.Column("cpu_wait_s", sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        batch.drop_column("cpu_wait_s")
