"""Property and fuzz tests: no input makes the collector answer 5xx or crash.

- hypothesis drives the ingest decoder with mutated frames and with every kind of valid record
  (tests/strategies.py derives them from the wire schema), on SQLite and on PostgreSQL;
- schemathesis generates requests for every operation of the OpenAPI spec.
A 4xx must carry a `detail` message; an ingest 4xx names `Type.field: problem`.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.collector import records as rec
from tests.strategies import any_record
from tests.support import pgcluster
from vigil import api, codec, schema
from vigil.collector import CollectorSettings, create_app

pytestmark = pytest.mark.integration
HEADERS = {"content-type": api.BATCH_MEDIA_TYPE}
_TYPES = "|".join(["Batch", "Record", *(t.__name__ for t in schema.RECORD_TYPES)])
# `Type.field: problem`, where an unknown tag reads `Record(type=<repr>)`.
DETAIL = re.compile(rf"^({_TYPES})(\(type=.*\))?\.\S.*: .+", re.DOTALL)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fuzz_client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    tmp = tmp_path_factory.mktemp("fuzz")
    if request.param == "sqlite":
        url = f"sqlite:///{tmp / 'fuzz.sqlite3'}"
    else:
        server: pgcluster.PostgresServer = request.getfixturevalue("postgres_server")
        url = server.new_database()
    settings_ = CollectorSettings(
        data_dir=tmp, store_url=url, max_batch_bytes=256 * 1024, max_batch_records=64
    )
    with TestClient(create_app(settings_)) as client:
        yield client


def _post(client: TestClient, body: bytes) -> tuple[int, object]:
    r = client.post(api.INGEST_PATH, content=body, headers=HEADERS)
    return r.status_code, r.json()


def _assert_answered(status: int, body: object) -> None:
    assert status < 500, body
    if status != 200:
        assert isinstance(body, dict) and DETAIL.match(str(body["detail"])), body


GOOD_FRAME = codec.encode_batch(
    [*rec.steps(2, 2), rec.sample("n1", 1.0, 2.0)], batch_id="seed", compress=False
)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=512),
        st.binary(max_size=256).map(lambda b: codec.MAGIC + b),
        # Flip, cut and splice bytes of a valid uncompressed frame.
        st.tuples(st.integers(0, len(GOOD_FRAME) - 1), st.integers(0, 255)).map(
            lambda p: GOOD_FRAME[: p[0]] + bytes([p[1]]) + GOOD_FRAME[p[0] + 1 :]
        ),
        st.integers(0, len(GOOD_FRAME)).map(lambda n: GOOD_FRAME[:n]),
    )
)
def test_mangled_frames_get_a_4xx_naming_the_problem(fuzz_client: TestClient, body: bytes) -> None:
    status, answer = _post(fuzz_client, body)
    _assert_answered(status, answer)


@FUZZ
@given(st.lists(any_record, min_size=1, max_size=8))
def test_any_valid_record_is_stored_or_refused_with_a_reason(
    fuzz_client: TestClient, records: list[schema.Record]
) -> None:
    batch_id = uuid.uuid4().hex  # fresh per example: hypothesis replays examples
    status, answer = _post(fuzz_client, codec.encode_batch(records, batch_id=batch_id))
    _assert_answered(status, answer)
    if status == 200:
        assert answer == {"batch_id": batch_id, "accepted": len(records), "duplicate": False}


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            ["job_id", "rank", "step", "start_s", "end_s", "loss", "mfu", "tokens", "type"]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**64 - 1),  # what msgpack can carry
            st.floats(),
            st.text(max_size=8),
            st.binary(max_size=8),
        ),
    )
)
def test_hand_made_records_with_wrong_types_are_refused_by_field(
    fuzz_client: TestClient, fields: dict[str, object]
) -> None:
    record = {"type": "step", **fields}
    frame = (
        codec.MAGIC
        + b"\x00"
        + msgspec.msgpack.encode({"v": 1, "batch_id": "hand", "records": [record]})
    )
    status, answer = _post(fuzz_client, frame)
    _assert_answered(status, answer)


# --- schemathesis over the OpenAPI spec ----------------------------------------------------------


# schemathesis' lazy fixture loader does not work with pytest 9, so the app is built at import;
# creating it opens nothing (the engine connects lazily) and the fixture below migrates it.
_SCHEMA_DIR = Path(tempfile.mkdtemp(prefix="vigil-schemathesis-"))
atexit.register(shutil.rmtree, _SCHEMA_DIR, True)
SCHEMA_APP = create_app(
    CollectorSettings(data_dir=_SCHEMA_DIR, store_url=f"sqlite:///{_SCHEMA_DIR / 's.sqlite3'}")
)
openapi = schemathesis.openapi.from_asgi("/openapi.json", SCHEMA_APP)
# Batch frames are opaque bytes to a generator: send them the way octet streams are sent.
schemathesis.serializer.alias(
    [api.BATCH_MEDIA_TYPE, "application/gzip"], "application/octet-stream"
)


@pytest.fixture(scope="module")
def schema_client() -> Iterator[TestClient]:
    store = SCHEMA_APP.state.collector.store
    store.migrate()
    store.ingest(schema.Batch(v=1, batch_id="seed", records=[*rec.steps(3, 3)]))
    with TestClient(SCHEMA_APP) as client:
        yield client


def _send(client: TestClient, case: schemathesis.Case) -> httpx.Response:
    """Send a generated case through the test client (schemathesis' own transport is built on
    requests + urllib3, which the urllib3-future package installed beside it breaks)."""
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    body: dict[str, Any] = {}
    if "json" in kwargs:
        body["json"] = kwargs["json"]
    elif kwargs.get("data") is not None:
        body["content"] = kwargs["data"]
    return client.request(
        kwargs["method"],
        kwargs["url"],
        params=kwargs.get("params"),
        headers=kwargs["headers"],
        **body,
    )


@openapi.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(
    schema_client: TestClient, case: schemathesis.Case
) -> None:
    response = _send(schema_client, case)
    assert response.status_code < 500, (case.method, case.formatted_path, response.text)
    if 400 <= response.status_code < 500:
        assert response.json()["detail"], response.text
