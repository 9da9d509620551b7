"""Fixtures: the same store tests run on a SQLite file and on a real PostgreSQL cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vigil.collector import Store, StoreConfig, pgcluster


class FakeClock:
    """A settable clock for retention tests (injected, never patched)."""

    def __init__(self, now_s: float = 1_800_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[pgcluster.PostgresServer]:
    server = pgcluster.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.sqlite3'}"
    server: pgcluster.PostgresServer = request.getfixturevalue("postgres_server")
    return server.new_database()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(store_url: str, clock: FakeClock) -> Iterator[Store]:
    s = Store(StoreConfig(url=store_url), clock=clock)
    s.migrate()
    try:
        yield s
    finally:
        s.close()
