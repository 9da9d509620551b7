"""The control routes over ASGI on SQLite: requests, a node's pending list, acks, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.collector.conftest import MakeClient
from vigil import api, codec, schema

HEADERS = {"content-type": api.BATCH_MEDIA_TYPE}


def _ranks(client: TestClient, job: str, nodes: dict[int, str]) -> None:
    records: list[schema.Record] = [
        schema.RankInfo(job_id=job, rank=rank, node=node, world_size=len(nodes))
        for rank, node in nodes.items()
    ]
    frame = codec.encode_batch(records, batch_id=f"ranks-{job}")
    assert client.post(api.INGEST_PATH, content=frame, headers=HEADERS).status_code == 200


@pytest.fixture
def client(make_client: MakeClient) -> TestClient:
    c = make_client()
    _ranks(c, "j", {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"})
    return c


def test_a_request_reaches_the_agents_of_its_ranks_nodes_until_they_ack(
    client: TestClient,
) -> None:
    made = client.post("/api/v1/jobs/j/control", json={"kind": "checkpoint", "id": "c-1"})
    assert made.status_code == 201, made.text
    assert made.json()["expected"] == [0, 1, 2, 3] and made.json()["done"] is False
    # The same id again answers the stored request; the same id for something else is refused.
    again = client.post("/api/v1/jobs/j/control", json={"kind": "checkpoint", "id": "c-1"})
    assert again.status_code == 200 and again.json()["created_s"] == made.json()["created_s"]
    other = client.post("/api/v1/jobs/j/control", json={"kind": "dump_stacks", "id": "c-1"})
    assert other.status_code == 409
    stacks = client.post("/api/v1/jobs/j/control", json={"kind": "dump_stacks", "ranks": [3]})
    assert stacks.status_code == 201 and stacks.json()["expected"] == [3]

    pending_a = client.get("/api/v1/control", params={"node": "node-a"}).json()
    assert [(p["id"], p["kind"], p["ranks"]) for p in pending_a] == [("c-1", "checkpoint", [0, 1])]
    pending_b = client.get("/api/v1/control", params={"node": "node-b"}).json()
    assert [(p["kind"], p["ranks"]) for p in pending_b] == [
        ("checkpoint", [2, 3]),
        ("dump_stacks", [3]),
    ]
    assert client.get("/api/v1/control", params={"node": "elsewhere"}).json() == []

    acked = client.post("/api/v1/control/c-1/ack", json={"node": "node-a", "ranks": [0, 1]})
    assert acked.status_code == 200 and acked.json()["acked"] == [0, 1]
    assert client.get("/api/v1/control", params={"node": "node-a"}).json() == []
    client.post("/api/v1/control/c-1/ack", json={"node": "node-b", "ranks": [2, 3]})
    status = client.get("/api/v1/jobs/j/control/c-1").json()
    assert status["acked"] == [0, 1, 2, 3] and status["done"] is True
    assert [p["kind"] for p in client.get("/api/v1/control", params={"node": "node-b"}).json()] == [
        "dump_stacks"
    ]
    # A dump_stacks answer carries the rank's stacks, read back with details=true.
    sid = stacks.json()["id"]
    body = {"node": "node-b", "ranks": [3], "details": {"3": "Thread 0x1 (most recent call)"}}
    assert client.post(f"/api/v1/control/{sid}/ack", json=body).status_code == 200
    plain = client.get(f"/api/v1/jobs/j/control/{sid}").json()
    assert plain["done"] is True and plain["details"] is None
    detailed = client.get(f"/api/v1/jobs/j/control/{sid}", params={"details": "true"}).json()
    assert detailed["details"] == {"3": "Thread 0x1 (most recent call)"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kind": "reboot"}, "kind"),
        ({"kind": "checkpoint", "ranks": [-1]}, "ranks"),
        ({"kind": "checkpoint", "ranks": "some"}, "ranks"),
        ({"kind": "checkpoint", "ranks": ["x"]}, "ranks"),
        ({"kind": "checkpoint", "ranks": []}, "ranks"),
        ({"kind": "checkpoint", "id": "has space"}, "id"),
        ({"kind": "checkpoint", "extra": 1}, "extra"),
    ],
)
def test_bad_requests_are_422_naming_the_field(
    client: TestClient, body: dict[str, object], field: str
) -> None:
    r = client.post("/api/v1/jobs/j/control", json=body)
    assert r.status_code == 422, r.text
    assert field in r.text
    assert client.get("/api/v1/control", params={"node": "node-a"}).json() == []


def test_bad_acks_and_unknown_requests(client: TestClient) -> None:
    client.post("/api/v1/jobs/j/control", json={"kind": "checkpoint", "ranks": [1], "id": "c"})
    stray = client.post("/api/v1/control/c/ack", json={"node": "node-a", "ranks": [0]})
    assert stray.status_code == 422 and "[0]" in stray.json()["detail"]
    assert (
        client.post("/api/v1/control/nope/ack", json={"node": "n", "ranks": [0]}).status_code == 404
    )
    assert client.post("/api/v1/control/c/ack", json={"node": "n", "ranks": []}).status_code == 422
    odd = {"node": "n", "ranks": [1], "details": {"2": "stacks"}}
    assert client.post("/api/v1/control/c/ack", json=odd).status_code == 422
    assert client.get("/api/v1/jobs/other/control/c").status_code == 404
    assert client.get("/api/v1/control").status_code == 422  # node is required


def test_control_takes_the_ingest_scope(make_client: MakeClient, tmp_path: Path) -> None:
    c = make_client(ingest_tokens=["in-tok"], read_tokens=["read-tok"])
    body = {"kind": "checkpoint"}
    assert c.post("/api/v1/jobs/j/control", json=body).status_code == 401
    read = {"Authorization": "Bearer read-tok"}
    assert c.post("/api/v1/jobs/j/control", json=body, headers=read).status_code == 403
    ingest = {"Authorization": "Bearer in-tok"}
    assert c.post("/api/v1/jobs/j/control", json=body, headers=ingest).status_code == 201
    assert c.get("/api/v1/control", params={"node": "n"}, headers=ingest).json() == []
