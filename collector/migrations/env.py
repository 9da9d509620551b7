"""Alembic environment of the collector's store: runs migrations on the connection it is handed.

`vigil.collector.migrate.upgrade` passes an open connection in `config.attributes["connection"]`;
the `alembic` CLI (for writing new revisions) passes a URL in `sqlalchemy.url` instead.
Must not configure logging: the `vigil` entry point owns it.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from vigil.collector import tables

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=tables.metadata,
        # SQLite cannot ALTER most things in place; batch mode recreates tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


main()
