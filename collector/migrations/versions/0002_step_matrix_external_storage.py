"""Store the step matrices' arrays uncompressed and out of line on PostgreSQL.

Packed float64 arrays hardly compress, so PostgreSQL's default (try pglz on every new version of
an 8 KiB+ value) burned CPU on each ingest patch for nothing. SQLite has no such setting.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 19:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("step_time", "comm_wait", "mfu")


def _set_storage(storage: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    alters = ", ".join(f"ALTER COLUMN {c} SET STORAGE {storage}" for c in _COLUMNS)
    op.execute(f"ALTER TABLE step_matrix {alters}")


def upgrade() -> None:
    _set_storage("EXTERNAL")


def downgrade() -> None:
    _set_storage("EXTENDED")
