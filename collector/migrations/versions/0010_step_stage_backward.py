"""Keep each step's time in a pipeline stage's backward passes, and the waits in there.

`stage_backward_s` (seconds the training thread spent in a `torch.distributed.pipelining`
stage's backward passes during the step) and `stage_backward_wait_s` (of them, its wait for a
CPU and its time blocked in collectives). The schedule receives a chunk's gradients before the
chunk's backward runs, so that time less its waits is the stage's own backward compute, which
the analyzer compares with the stage's own earlier steps. Rows stored before this revision, and
senders that do not report them, hold 0 (none timed). Self-contained: must not import vigil,
whose layout may move on.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 18:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        for name in ("stage_backward_s", "stage_backward_wait_s"):
            batch.add_column(sa.Column(name, sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("step_records") as batch:
        batch.drop_column("stage_backward_wait_s")
        batch.drop_column("stage_backward_s")
