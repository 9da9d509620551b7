"""The node agent's relay: this node's ranks' batches to the collector, several per request.

Every rank's SDK ships its own batch each flush, so a job of R ranks costs its collector R
requests a second; a collector stores a few hundred lone batches a second (README, limits).
Pointed at the relay (`VIGIL_COLLECTOR_URL=http://<agent>:<relay port>`), the SDKs of a node
POST their frames here exactly as to a collector. The relay holds each request while a window
is open, then POSTs the frames gathered as one envelope (`vigil.codec.encode_frames`) to the
collector's `api.INGEST_FRAMES_PATH`, and answers every sender with its own frame's result (the
status and body a lone POST would have had).

A window opens with its first frame and closes once every sender seen in the last
`expect_s` has a frame in it, or after `window_s`, or at `max_frames` / `max_bytes`. Ranks
answered together flush again together, so after the first window a node's ranks arrive at
once and a window closes as soon as the last one's frame is in.

It keeps nothing: a frame is acknowledged only once the collector committed it, so the sender's
own spool holds it until then; a collector away is a 502 (the sender spools and retries, and an
outage sets nothing aside: `vigil.delivery.is_poison`). Frames
travel with their sender's own Authorization header (one envelope per header), so the relay
holds no token and grants nothing. A lone frame, or a collector without the frames path (404,
405) or one that refuses the envelope as too large (413), gets each frame POSTed alone.
Exactly once is the collector's, by batch id. Threads only; imports no collector code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from vigil import api, codec

log = logging.getLogger(__name__)
_RETRY_AFTER_S = "2"
# A lone frame's bounds at the collector (VIGIL_MAX_BATCH_BYTES' default): larger ones are not
# read, and a window's envelope stays below it.
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a sender is answered: status, JSON body, extra headers."""

    status: int
    body: bytes
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


def _reply(status: int, detail: str, *, retry: bool = False) -> Reply:
    headers = {"Retry-After": _RETRY_AFTER_S} if retry else {}
    return Reply(status, json.dumps({"detail": detail}).encode(), headers)


@dataclasses.dataclass(eq=False)
class _Slot:
    frame: bytes
    authorization: str | None
    sender: str
    reply: Reply | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class RelayStats:
    frames: int = 0  # frames answered
    requests: int = 0  # requests made to the collector
    windows: int = 0


class Relay:
    """Gathers frames and forwards them (see the module docstring); `relay` is thread-safe."""

    def __init__(
        self,
        collector_url: str,
        *,
        window_s: float = 1.0,
        expect_s: float = 5.0,
        max_frames: int = 256,
        max_bytes: int = 8 * 1024 * 1024,
        timeout_s: float = 3.0,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or expect_s <= 0 or timeout_s <= 0:
            raise ValueError(
                f"window_s, expect_s and timeout_s must be > 0, got {window_s}, {expect_s}, "
                f"{timeout_s}"
            )
        if max_frames < 1 or not 0 < max_bytes <= MAX_BODY_BYTES:
            raise ValueError(
                f"max_frames must be >= 1 and max_bytes 1..{MAX_BODY_BYTES}, got {max_frames} "
                f"and {max_bytes}"
            )
        self._base = collector_url.rstrip("/")
        self.window_s, self.expect_s = window_s, expect_s
        self.max_frames, self.max_bytes, self.timeout_s = max_frames, max_bytes, timeout_s
        self._client = client or httpx.Client(timeout=timeout_s)
        self._owns_client = client is None
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: list[_Slot] = []
        self._seen: dict[str, float] = {}  # sender -> when its last frame came
        self._closed = False
        self.stats = RelayStats()
        self._thread = threading.Thread(target=self._run, name="vigil-agent-relay", daemon=True)
        self._thread.start()

    def relay(self, frame: bytes, authorization: str | None, sender: str) -> Reply:
        """Forward one sender's frame; blocks until the collector answered it (or gave up)."""
        slot = _Slot(frame, authorization, sender)
        with self._cond:
            if self._closed:
                return _reply(503, "Batch.<relay>: the node agent is stopping; retry", retry=True)
            self._pending.append(slot)
            self._seen[sender] = self._clock()
            self._cond.notify_all()
        if not slot.done.wait(self.window_s + 2 * self.timeout_s + 5):
            return _reply(503, "Batch.<relay>: the collector did not answer in time", retry=True)
        assert slot.reply is not None
        return slot.reply

    def close(self) -> None:
        """Answer what is pending, stop the thread, close the client."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(self.window_s + 2 * self.timeout_s + 5)
        if self._owns_client:
            self._client.close()

    def _run(self) -> None:
        while True:
            taken = self._window()
            if not taken:
                return
            self.stats.windows += 1
            groups: dict[str | None, list[_Slot]] = {}
            for slot in taken:
                groups.setdefault(slot.authorization, []).append(slot)
            for authorization, slots in groups.items():
                try:
                    self._forward(slots, authorization)
                except Exception as exc:  # never leave a sender without an answer
                    log.error("relay failed: %s", exc, exc_info=exc)
                    for slot in slots:
                        slot.reply = slot.reply or _reply(500, "Batch.<relay>: relay error")
                for slot in slots:
                    self.stats.frames += 1
                    slot.done.set()

    def _window(self) -> list[_Slot]:
        """The next window's frames, once it closes ([] once closed with nothing pending)."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return []
            opened = self._clock()
            while not self._closed and not self._full():
                left = opened + self.window_s - self._clock()
                if left <= 0 or self._everyone_in():
                    break
                self._cond.wait(left)
            taken: list[_Slot] = []
            size = 0
            while self._pending and len(taken) < self.max_frames:
                if taken and size + len(self._pending[0].frame) > self.max_bytes:
                    break
                size += len(self._pending[0].frame)
                taken.append(self._pending.pop(0))
            return taken

    def _full(self) -> bool:
        return len(self._pending) >= self.max_frames or (
            sum(len(s.frame) for s in self._pending) >= self.max_bytes
        )

    def _everyone_in(self) -> bool:
        now = self._clock()
        for sender, at in list(self._seen.items()):
            if now - at > self.expect_s:
                del self._seen[sender]
        waiting = {s.sender for s in self._pending}
        return all(sender in waiting for sender in self._seen)

    def _headers(self, authorization: str | None, media: str) -> dict[str, str]:
        headers = {"content-type": media}
        if authorization:
            headers["Authorization"] = authorization
        return headers

    def _forward(self, slots: list[_Slot], authorization: str | None) -> None:
        if len(slots) > 1:
            envelope = codec.encode_frames([s.frame for s in slots])
            response = self._post(
                api.INGEST_FRAMES_PATH,
                envelope,
                self._headers(authorization, api.FRAMES_MEDIA_TYPE),
            )
            if response is None or response.status_code not in (404, 405, 413):
                self._settle(slots, response)
                return
        for slot in slots:  # alone: one frame, or a collector that takes no envelope
            response = self._post(
                api.INGEST_PATH, slot.frame, self._headers(authorization, api.BATCH_MEDIA_TYPE)
            )
            slot.reply = _answer(response)

    def _post(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response | None:
        self.stats.requests += 1
        try:
            return self._client.post(self._base + path, content=body, headers=headers)
        except httpx.HTTPError as exc:
            log.warning("relay to %s failed: %s: %s", self._base, type(exc).__name__, exc)
            return None

    def _settle(self, slots: list[_Slot], response: httpx.Response | None) -> None:
        """Each slot's reply from an envelope's answer."""
        if response is None or response.status_code != 200:  # the same answer for every frame
            for slot in slots:
                slot.reply = _answer(response)
            return
        try:
            results = response.json()["results"]
        except (ValueError, KeyError, TypeError):
            results = None
        if not isinstance(results, list) or len(results) != len(slots):
            for slot in slots:
                slot.reply = _reply(502, "Batch.<relay>: the collector's answer was malformed")
            return
        for slot, result in zip(slots, results, strict=True):
            body = dict(result)
            status = int(body.pop("status", 502))
            retry = {"Retry-After": _RETRY_AFTER_S} if status == 503 else {}
            slot.reply = Reply(status, json.dumps(body).encode(), retry)


def _answer(response: httpx.Response | None) -> Reply:
    """A collector's answer passed on (a collector away: 502, which senders spool and retry)."""
    if response is None:
        return _reply(502, "Batch.<relay>: the collector is unreachable; retry", retry=True)
    headers = {}
    if "Retry-After" in response.headers:
        headers["Retry-After"] = response.headers["Retry-After"]
    return Reply(response.status_code, response.content, headers)


def serve(relay: Relay, host: str, port: int) -> ThreadingHTTPServer:
    """The relay's HTTP endpoint (POST `api.INGEST_PATH`, as a collector's), serving on a
    thread of its own; `shutdown()` the server returned to stop it."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: each rank holds one connection

        def do_POST(self) -> None:
            if self.path.split("?")[0] != api.INGEST_PATH:
                self._send(_reply(404, f"not found: the relay takes POST {api.INGEST_PATH}"))
                return
            length = self.headers.get("content-length", "")
            if not length.isdigit():
                self._send(_reply(411, "Batch.<frame>: the relay needs a content-length"))
                self.close_connection = True
                return
            if int(length) > MAX_BODY_BYTES:
                self._send(
                    _reply(413, f"Batch.<frame>: body exceeds the {MAX_BODY_BYTES} byte limit")
                )
                self.close_connection = True
                return
            body = self.rfile.read(int(length))
            media = self.headers.get("content-type", "").split(";")[0].strip().lower()
            if media not in (api.BATCH_MEDIA_TYPE, "application/octet-stream"):
                detail = f"Batch.<frame>: content type must be {api.BATCH_MEDIA_TYPE}"
                self._send(_reply(415, detail))
                return
            sender = f"{self.client_address[0]}:{self.client_address[1]}"
            self._send(relay.relay(body, self.headers.get("authorization"), sender))

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._send(Reply(200, b'{"status":"ok"}'))
            else:
                self._send(_reply(404, "not found"))

        def _send(self, reply: Reply) -> None:
            self.send_response(reply.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(reply.body)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("relay: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(
        target=server.serve_forever, name="vigil-agent-relay-http", daemon=True
    ).start()
    return server


class RelayServer:
    """A `Relay` serving on (host, port) (0: any free port), as `vigil agent --relay-port`
    runs it: `url` is what this node's ranks ship to; `close()` (or the end of a `with`
    block) stops taking requests, answers those pending and stops the relay."""

    def __init__(self, collector_url: str, host: str = "127.0.0.1", port: int = 0, **relay: Any):
        self.relay = Relay(collector_url, **relay)
        try:
            self._server = serve(self.relay, host, port)
        except OSError:
            self.relay.close()
            raise
        self.port = int(self._server.server_port)
        self.url = f"http://{host}:{self.port}"

    @property
    def stats(self) -> RelayStats:
        return self.relay.stats

    def close(self) -> None:
        self._server.shutdown()
        self.relay.close()
        self._server.server_close()

    def __enter__(self) -> RelayServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
