"""Brings a store's schema up to date with the Alembic revisions shipped in `migrations/`.

Called once at collector start, before any request is served. Must not create tables any other
way: the migrations are the schema's history.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str = "") -> Config:
    """An Alembic config pointing at the packaged migrations (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the collector ships at least one migration"
    return head


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine) -> str:
    """Apply every pending migration in one transaction; return the revision now in force."""
    config = alembic_config()
    with engine.begin() as connection:
        before = current_revision(connection)
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
        after = current_revision(connection)
    if before != after:
        log.info("store schema migrated from %s to %s", before or "empty", after)
    assert after is not None
    return after
