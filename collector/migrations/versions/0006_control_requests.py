"""Keep control requests for running ranks and their acknowledgements.

`control_requests`: one row per request (checkpoint now, dump stacks) the recovery controller
posted for a job, for some ranks or (ranks null) every rank. `control_acks`: one row per rank
whose SDK acknowledged the request, posted by the node agent of the rank's node, with what the
rank answered (`detail`: a dump_stacks request's stacks).
Self-contained: must not import vigil, whose layout may move on.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 17:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = 256


def upgrade() -> None:
    op.create_table(
        "control_requests",
        sa.Column("request_id", sa.String(NAME), primary_key=True, nullable=False),
        sa.Column("job_id", sa.String(NAME), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=True),
        sa.Column("created_s", sa.Double(), nullable=False),
    )
    op.create_index("ix_control_requests_job", "control_requests", ["job_id", "created_s"])
    op.create_table(
        "control_acks",
        sa.Column("request_id", sa.String(NAME), primary_key=True, nullable=False),
        sa.Column("rank", sa.BigInteger(), primary_key=True, nullable=False),
        sa.Column("node", sa.String(NAME), nullable=False),
        sa.Column("acked_s", sa.Double(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_table("control_acks")
    op.drop_index("ix_control_requests_job", table_name="control_requests")
    op.drop_table("control_requests")
