"""Keep what cross-rank wait attribution reads: aggregates' last op and overlap; ranks' world size.

`last_device_s` (the duration of the step's last op of a group and op) and `overlapped` (the
ops ran behind compute and their wait is hidden from the SDK, as DDP's gradient buckets are):
the analyzer takes an overlapped aggregate's exposed wait from its last op across ranks.
`ranks.world_size`: every rank reports the job's size, not only rank 0's Job record.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 10:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(
            sa.Column("world_size", sa.BigInteger(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("coll_aggs") as batch:
        batch.add_column(
            sa.Column("last_device_s", sa.Double(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("overlapped", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("coll_aggs") as batch:
        batch.drop_column("overlapped")
        batch.drop_column("last_device_s")
    with op.batch_alter_table("ranks") as batch:
        batch.drop_column("world_size")
