"""Keep the restart record of recovery actions: attempt, resume step, steps lost, recovered at.

A restart action names the attempt it launched (`attempt`, 0 = first start), the first step that
attempt trained (`resume_step`), the steps trained before the failure that were trained again
(`steps_lost`) and when the new attempt's first step was seen (`recovered_s`, Unix s). Rows
stored before this revision, and actions other than restarts, hold -1 (unknown) and 0 (not yet).
Self-contained: must not import vigil, whose layout may move on.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 15:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INTS = ("attempt", "resume_step", "steps_lost")


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        for name in _INTS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default="-1"))
        batch.add_column(sa.Column("recovered_s", sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.drop_column("recovered_s")
        for name in reversed(_INTS):
            batch.drop_column(name)
