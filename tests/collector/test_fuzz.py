"""Property and fuzz tests: no input makes the collector answer 5xx or crash.

- hypothesis drives the ingest decoder with mutated frames, with every kind of valid record
  (tests/strategies.py derives them from the wire schema) and with step records holding one bad
  field, on SQLite and on PostgreSQL. Both directions are asserted: records within the collector's
  documented bounds are answered 200 and stored, one row each; a record with a bad field is
  answered 4xx naming that field, and nothing of its batch is stored;
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
from sqlalchemy import func, select

from tests.collector import records as rec
from tests.strategies import any_record
from tests.support import pgcluster
from vigil import api, codec, schema
from vigil.collector import CollectorSettings, create_app, tables, validate

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


_FRAMES_DETAIL = re.compile(r"^Frames\.(<frames>|\[\d+\]): .+|^Batch\.<frame>: .+", re.DOTALL)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=512),
        # Envelopes of mangled frames beside good ones, and cut envelopes.
        st.lists(
            st.one_of(
                st.just(GOOD_FRAME),
                st.binary(min_size=1, max_size=128),
                st.integers(1, len(GOOD_FRAME)).map(lambda n: GOOD_FRAME[:n]),
            ),
            min_size=1,
            max_size=6,
        ).map(codec.encode_frames),
        st.tuples(st.lists(st.just(GOOD_FRAME), min_size=1, max_size=3), st.integers(0, 64)).map(
            lambda p: codec.encode_frames(p[0])[: -p[1] or None]
        ),
    )
)
def test_mangled_envelopes_get_an_answer_per_frame_or_a_4xx(
    fuzz_client: TestClient, body: bytes
) -> None:
    r = fuzz_client.post(
        api.INGEST_FRAMES_PATH, content=body, headers={"content-type": api.FRAMES_MEDIA_TYPE}
    )
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert _FRAMES_DETAIL.match(r.json()["detail"]), r.text
        return
    frames = codec.split_frames(body, max_frames=4096)
    results = r.json()["results"]
    assert len(results) == len(frames)
    for frame, result in zip(frames, results, strict=True):
        if frame == GOOD_FRAME:
            assert result["status"] == 200, result
        else:
            _assert_answered(result["status"], result)


# The collector's documented bounds beyond the wire schema (the ingest route's docstring): ranks
# below the job's world size (at most VIGIL_MAX_WORLD_SIZE, 131,072 by default), step numbers
# below 2**53, no NUL characters (PostgreSQL text cannot hold them).
MAX_WORLD = CollectorSettings.model_fields["max_world_size"].default
# The table each record type is stored in, and the column that holds its owner.
TABLE_OF = {
    schema.Job: tables.jobs,
    schema.RankInfo: tables.ranks,
    schema.StepRecord: tables.step_records,
    schema.CollectiveAggregate: tables.coll_aggs,
    schema.CollectiveEvent: tables.coll_events,
    schema.Heartbeat: tables.heartbeats,
    schema.Sample: tables.samples,
    schema.Finding: tables.findings,
    schema.Action: tables.actions,
    schema.Checkpoint: tables.checkpoints,
    schema.DiagResult: tables.diag_results,
}
assert set(TABLE_OF) == set(schema.RECORD_TYPES)


def _no_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "0")  # same length: a Name stays non-empty
    if isinstance(value, list):
        return [_no_nul(v) for v in value]
    if isinstance(value, dict):
        return {k: _no_nul(v) for k, v in value.items()}
    return value


def _within_bounds(record: schema.Record, owner: str) -> schema.Record:
    """`record` moved inside the collector's bounds and made the only record of job (or node,
    finding, action) `owner`, so no earlier example's world size or row can bear on it."""
    fields: dict[str, Any] = _no_nul(msgspec.to_builtins(record))  # defaults left out
    for key in ("job_id", "finding_id", "action_id"):
        if key in type(record).__struct_fields__:
            fields[key] = owner
    if isinstance(record, schema.DiagResult):
        fields["node"] = owner
    if "world_size" in fields:
        fields["world_size"] = min(fields["world_size"], MAX_WORLD)
    if fields.get("rank", -1) >= 0:
        fields["rank"] %= fields.get("world_size") or MAX_WORLD
    if isinstance(record, schema.StepRecord):
        fields["step"] = min(fields["step"], validate.MAX_STEP)
    bounded: schema.Record = msgspec.convert(fields, schema.Record)
    return bounded


def _rows_owned(client: TestClient, record: schema.Record, owner: str) -> int:
    table = TABLE_OF[type(record)]
    column = table.c.node if isinstance(record, schema.DiagResult) else table.c.job_id
    with client.app.state.collector.store.read() as conn:  # type: ignore[attr-defined]
        query = select(func.count()).select_from(table).where(column == owner)
        return int(conn.execute(query).scalar_one())


@FUZZ
@given(st.lists(any_record, min_size=1, max_size=8))
def test_valid_records_within_the_bounds_are_accepted_and_stored(
    fuzz_client: TestClient, records: list[schema.Record]
) -> None:
    batch_id = uuid.uuid4().hex  # fresh per example: hypothesis replays examples
    owners = [f"{batch_id}-{i}" for i in range(len(records))]
    records = [_within_bounds(r, owner) for r, owner in zip(records, owners, strict=True)]
    status, answer = _post(fuzz_client, codec.encode_batch(records, batch_id=batch_id))
    assert status == 200, answer
    assert answer == {"batch_id": batch_id, "accepted": len(records), "duplicate": False}
    stored = [_rows_owned(fuzz_client, r, owner) for r, owner in zip(records, owners, strict=True)]
    assert stored == [1] * len(records), records


@FUZZ
@given(st.lists(any_record, min_size=1, max_size=8))
def test_any_valid_record_is_stored_or_refused_with_a_reason(
    fuzz_client: TestClient, records: list[schema.Record]
) -> None:
    """Records anywhere in the wire schema's range, past the collector's bounds included."""
    batch_id = uuid.uuid4().hex
    status, answer = _post(fuzz_client, codec.encode_batch(records, batch_id=batch_id))
    _assert_answered(status, answer)
    if status == 200:
        assert answer == {"batch_id": batch_id, "accepted": len(records), "duplicate": False}


MISSING = object()  # the field left out of the record
_ANY_INT = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
GOOD_STEP = {"job_id": "hand", "rank": 1, "step": 2, "start_s": 1.0, "end_s": 2.0, "loss": 0.5}
_NOT_A_NUMBER = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.binary(max_size=8))
_BAD_INT = st.one_of(
    _NOT_A_NUMBER,
    st.floats(),
    st.integers(-(2**63), -1),
    st.integers(min_value=2**63, max_value=2**64 - 1),  # past int64, still msgpack
)
_BAD_FLOAT = st.one_of(
    _NOT_A_NUMBER,
    st.floats(max_value=-1e-300),
    st.integers(-(2**63), -1),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
# For each field of a step record, values it cannot hold (wrong type or past a bound).
BAD_VALUES: dict[str, st.SearchStrategy[object]] = {
    "type": st.one_of(st.text(max_size=8).filter(lambda t: t not in schema.RECORD_TAGS), _ANY_INT),
    "job_id": st.one_of(
        st.none(),
        st.booleans(),
        _ANY_INT,
        st.floats(),
        st.binary(max_size=8),
        st.just(""),
        st.text(min_size=257, max_size=300),
        st.text(max_size=8).map(lambda t: t + "\x00"),
    ),
    "rank": st.one_of(_BAD_INT, st.integers(MAX_WORLD, 2**64 - 1)),
    "step": st.one_of(_BAD_INT, st.integers(validate.MAX_STEP + 1, 2**64 - 1)),
    "tokens": _BAD_INT,
    "start_s": _BAD_FLOAT,
    "end_s": _BAD_FLOAT,
    "mfu": _BAD_FLOAT,
    "loss": st.one_of(st.booleans(), st.text(max_size=8), st.binary(max_size=8)),
}
REQUIRED = ("job_id", "rank", "step", "start_s", "end_s")


@FUZZ
@given(
    st.one_of(
        st.sampled_from(sorted(BAD_VALUES)).flatmap(lambda f: st.tuples(st.just(f), BAD_VALUES[f])),
        st.tuples(st.sampled_from(REQUIRED), st.just(MISSING)),
    )
)
def test_hand_made_records_with_a_bad_field_are_refused_by_field(
    fuzz_client: TestClient, bad: tuple[str, object]
) -> None:
    field, value = bad
    record: dict[str, object] = {"type": "step", **GOOD_STEP}
    if value is MISSING:
        del record[field]
    else:
        record[field] = value
    batch_id = uuid.uuid4().hex
    envelope = {"v": 1, "batch_id": batch_id, "records": [record]}
    frame = codec.MAGIC + b"\x00" + msgspec.msgpack.encode(envelope)
    status, answer = _post(fuzz_client, frame)
    assert 400 <= status < 500, (status, answer)
    _assert_answered(status, answer)
    assert isinstance(answer, dict)
    detail = str(answer["detail"])
    owner = "Record(type=" if field == "type" else "StepRecord."
    assert detail.startswith(owner) and re.search(rf"\b{field}\b", detail), detail
    assert fuzz_client.app.state.collector.store.batch_seen(batch_id) is None  # type: ignore[attr-defined]


def test_the_good_step_record_alone_is_accepted(fuzz_client: TestClient) -> None:
    """The refusals above come from the one bad field, not from the rest of the record."""
    envelope = {"v": 1, "batch_id": uuid.uuid4().hex, "records": [{"type": "step", **GOOD_STEP}]}
    status, answer = _post(fuzz_client, codec.MAGIC + b"\x00" + msgspec.msgpack.encode(envelope))
    assert status == 200 and answer["accepted"] == 1, answer  # type: ignore[index]


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
    [api.BATCH_MEDIA_TYPE, api.FRAMES_MEDIA_TYPE, "application/gzip"], "application/octet-stream"
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
