"""`vigil dashboards push` against a small HTTP server in this test that checks each request
follows Grafana's documented HTTP API (folders: GET /api/folders/:uid, POST /api/folders;
dashboards: POST /api/dashboards/db with {dashboard, folderUid, overwrite}; bearer token auth).
It is NOT Grafana: no Grafana server exists on these machines. Errors are one line and never
show the token.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vigil import cli
from vigil.collector.grafana import dashboards

TOKEN = "glsa_test-secret-token"


class FakeGrafana:
    """Grafana's folder and dashboard endpoints, as documented, over an in-memory store."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.folders: dict[str, str] = {}
        self.boards: dict[str, dict[str, Any]] = {}
        self.problems: list[str] = []
        self.requests: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {owner.token}":
                    self._answer(401, {"message": "invalid API key"})
                    return False
                return True

            def do_GET(self) -> None:
                owner.requests.append(("GET", self.path))
                if not self._authorized():
                    return
                if self.path.startswith("/api/folders/"):
                    uid = self.path.rsplit("/", 1)[1]
                    if uid in owner.folders:
                        self._answer(200, {"uid": uid, "title": owner.folders[uid]})
                    else:
                        self._answer(404, {"message": "folder not found"})
                    return
                self._answer(404, {"message": "not found"})

            def do_POST(self) -> None:
                owner.requests.append(("POST", self.path))
                if not self._authorized():
                    return
                if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
                    owner.problems.append(f"{self.path}: content type {self.headers}")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/api/folders":
                    if set(body) - {"title", "uid", "parentUid"} or "title" not in body:
                        owner.problems.append(f"folder body {body}")
                    owner.folders[body["uid"]] = body["title"]
                    self._answer(200, {"uid": body["uid"], "title": body["title"], "id": 1})
                elif self.path == "/api/dashboards/db":
                    owner.check_dashboard(body)
                    board = body["dashboard"]
                    owner.boards[board["uid"]] = body
                    self._answer(200, {"id": 1, "uid": board["uid"], "status": "success",
                                       "version": 1, "url": f"/d/{board['uid']}/x"})  # fmt: skip
                else:
                    self._answer(404, {"message": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def check_dashboard(self, body: dict[str, Any]) -> None:
        """What Grafana's POST /api/dashboards/db requires of the body."""
        board = body.get("dashboard")
        if not isinstance(board, dict) or not board.get("title") or not board.get("uid"):
            self.problems.append("dashboard without title/uid")
            return
        if board.get("id") is not None:
            self.problems.append(f"{board['uid']}: a new dashboard must have id null")
        if body.get("overwrite") is not True:
            self.problems.append(f"{board['uid']}: overwrite not true (a re-push would fail)")
        if body.get("folderUid") not in self.folders:
            self.problems.append(f"{board['uid']}: folderUid {body.get('folderUid')} unknown")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    server = FakeGrafana(TOKEN)
    try:
        yield server
    finally:
        server.close()


def test_push_creates_the_folder_and_uploads_every_dashboard(
    grafana: FakeGrafana, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VIGIL_GRAFANA_TOKEN", TOKEN)
    assert cli.main(["dashboards", "push", "--grafana", grafana.url]) == 0
    assert grafana.problems == []
    assert grafana.folders == {"vigil": "vigil"}
    assert set(grafana.boards) == set(dashboards.UIDS.values())
    sent = grafana.boards["vigil-training-job"]["dashboard"]
    assert sent["panels"] == dashboards.training_job()["panels"]
    out = capsys.readouterr()
    assert "pushed 4 dashboards" in out.out and TOKEN not in out.out + out.err
    # Again: the folder exists now (no second POST), dashboards are overwritten.
    before = sum(1 for r in grafana.requests if r == ("POST", "/api/folders"))
    assert cli.main(["dashboards", "push", "--grafana", grafana.url, "--token", TOKEN]) == 0
    assert sum(1 for r in grafana.requests if r == ("POST", "/api/folders")) == before == 1
    assert grafana.problems == []


def test_a_wrong_token_is_one_line_without_the_token(
    grafana: FakeGrafana, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = "glsa_wrong-token-value"
    code = cli.main(["dashboards", "push", "--grafana", grafana.url, "--token", wrong])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines() == [
        f"vigil dashboards: Grafana at {grafana.url} refused the token (401)"
    ]
    assert wrong not in err and not grafana.boards


def test_unreachable_grafana_and_a_missing_token_are_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}"
    code = cli.main(["dashboards", "push", "--grafana", url, "--token", TOKEN, "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"vigil dashboards: cannot reach Grafana at {url}")
    assert TOKEN not in err
    monkeypatch.delenv("VIGIL_GRAFANA_TOKEN", raising=False)
    assert cli.main(["dashboards", "push", "--grafana", url]) == 1
    assert "a Grafana token is needed" in capsys.readouterr().err


def test_export_into_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    assert cli.main(["dashboards", "export", str(target)]) == 1
    err = capsys.readouterr().err
    assert err == f"vigil dashboards: {target} exists and is not a directory\n"
    assert cli.main(["dashboards", "export", str(tmp_path / "d"), "--dashboards-path", "rel"]) == 1
    assert "dashboards_path must be absolute" in capsys.readouterr().err
