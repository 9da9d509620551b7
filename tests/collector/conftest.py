"""Fixtures: the same store tests run on a SQLite file and on a real PostgreSQL cluster."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support import pgcluster
from vigil.collector import (
    CollectorSettings,
    Store,
    StoreConfig,
    StreamAnalyzer,
    create_app,
)


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


MakeClient = Callable[..., TestClient]


@pytest.fixture
def make_client(tmp_path: Path) -> Iterator[MakeClient]:
    clients: list[TestClient] = []

    def make(
        *,
        analyzer: StreamAnalyzer | None = None,
        store_url: str = "",
        clock: Callable[[], float] = time.time,
        raise_server_exceptions: bool = True,
        **fields: object,
    ) -> TestClient:
        url = store_url or f"sqlite:///{tmp_path / f'store{len(clients)}.sqlite3'}"
        settings = CollectorSettings(data_dir=tmp_path, store_url=url, **fields)  # type: ignore[arg-type]
        app = create_app(settings, analyzer=analyzer, clock=clock)
        client = TestClient(app, raise_server_exceptions=raise_server_exceptions)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)
