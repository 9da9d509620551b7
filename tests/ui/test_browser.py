"""The web UI in Debian's headless Chromium (Playwright for Python, never a downloaded browser):
every page renders with no console error; job -> heat-map cell -> rank detail -> trace download
yields a Chrome trace; a real 4-rank gloo job's straggler stands out in its heat map (the value
the page holds and the canvas pixel); pages update live; names cannot inject markup; the read
token is asked once, kept in sessionStorage and sent as a header, never in a URL.

A real collector app is served by uvicorn on loopback in this process; the real job ships to it
through the public SDK (tests/realjobs). Screenshots go to build/ui-screenshots/.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.collector import records as rec
from tests.realjobs import launch as launcher
from vigil import api, codec, schema
from vigil.analyzer import StreamingAnalyzer
from vigil.collector import CollectorSettings, create_app

playwright_sync = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[2] / "build" / "ui-screenshots"
XSS = "<img src=x onerror=alert(1)>"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)"),
]


class Served:
    """A collector app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, tmp: Path, **fields: Any) -> None:
        settings = CollectorSettings(
            data_dir=tmp,
            store_url=f"sqlite:///{tmp / 'ui.sqlite3'}",
            **fields,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        app = create_app(settings, analyzer=StreamingAnalyzer())
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "collector did not start"
            time.sleep(0.05)

    def post(self, records: list[schema.Record], token: str = "") -> None:
        headers = {"content-type": api.BATCH_MEDIA_TYPE}
        if token:
            headers["authorization"] = f"Bearer {token}"
        r = httpx.post(
            self.url + api.INGEST_PATH,
            content=codec.encode_batch(records),
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 200, r.text

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    try:
        yield s
    finally:
        s.stop()


class Page:
    """A page with its console errors, page errors and dialogs collected."""

    def __init__(self, browser: Any, **context: Any) -> None:
        self.context = browser.new_context(
            viewport={"width": 1400, "height": 1000}, accept_downloads=True, **context
        )
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)

    def js(self, expression: str) -> Any:
        return self.page.evaluate(expression)

    def until(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Poll a JS expression until truthy (page.wait_for_function needs eval, which the
        UI's Content-Security-Policy forbids)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"never true: {expression}")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[..., Page]]:
    pages: list[Page] = []

    def make(**context: Any) -> Page:
        pages.append(Page(browser, **context))
        return pages[-1]

    yield make
    for p in pages:
        p.close()


def _job_records(job: str, *, ranks: int, steps: int, slow_rank: int) -> list[schema.Record]:
    out: list[schema.Record] = [
        schema.Job(
            job_id=job,
            name=job,
            world_size=ranks,
            layout=schema.ParallelLayout(dp=ranks // 2, tp=2),
            device_kind="cpu",
        )
    ]
    out += [
        schema.RankInfo(job_id=job, rank=r, node=f"node-{r // 4}", world_size=ranks)
        for r in range(ranks)
    ]
    for s in range(steps):
        for r in range(ranks):
            slow = r == slow_rank and s >= 10
            out.append(rec.step(r, s, job=job, seconds=1.5 if slow else 0.5, wait=0.1))
            out.append(
                schema.CollectiveAggregate(
                    job_id=job,
                    rank=r,
                    step=s,
                    group="dp0",
                    op="all_reduce",
                    count=4,
                    bytes=1 << 20,
                    total_device_s=0.05,
                    max_device_s=0.02,
                    total_wait_s=0.0 if slow else 0.04,
                    last_seq=s * 4 + 3,
                )
            )
    detected = 1_700_000_000.0 + 20
    out.append(
        schema.Finding(
            finding_id=f"{job}-straggler",
            kind=schema.FindingKind.STRAGGLER,
            job_id=job,
            subjects=schema.Subjects(ranks=[slow_rank]),
            step_start=10,
            step_end=steps - 1,
            summary=f"rank {slow_rank} is a compute straggler",
            evidence=[schema.Evidence(metric="compute_s", observed=1.4, baseline=0.4, unit="s")],
            confidence=0.95,
            detected_s=detected,
        )
    )
    out.append(
        schema.Action(
            action_id=f"{job}-restart",
            kind=schema.ActionKind.RESTART,
            job_id=job,
            finding_id=f"{job}-straggler",
            state=schema.ActionState.SUCCEEDED,
            start_s=detected + 1,
            end_s=detected + 2,
            attempt=1,
            resume_step=18,
            steps_lost=2,
            recovered_s=detected + 7.5,
        )
    )
    out.append(schema.Checkpoint(job_id=job, step=15, location="/ckpt/step-15", bytes=1 << 30))
    return out


def _cell_point(page: Page, rank: int, step: int) -> tuple[float, float]:
    box = page.page.locator("canvas#heatmap").bounding_box()
    assert box is not None
    at = page.js(f"vigil.heat.pixelOf({rank}, {step})")
    return box["x"] + at["x"], box["y"] + at["y"]


def test_click_path_job_cell_rank_detail_trace_download(
    served: Served, open_page: Callable[..., Page]
) -> None:
    served.post(_job_records("train-8", ranks=8, steps=40, slow_rank=5))
    p = open_page()
    p.page.goto(served.url + "/")
    assert p.page.url.endswith("/ui/")
    p.page.wait_for_selector("a.job-link")
    assert "1 of 1 jobs" in p.page.inner_text("#jobs-note")
    row = p.page.inner_text("#jobs-table tbody tr")
    assert "train-8" in row and "dp4 · tp2" in row
    p.shot("jobs")
    p.page.click("a.job-link")
    p.page.wait_for_selector("canvas#heatmap[data-paints]")
    p.page.wait_for_selector("#findings .finding")
    assert "detected straggler" in p.page.inner_text("#recovery")
    assert "time to recover 7.50 s" in p.page.inner_text("#recovery")
    assert "steps lost 2" in p.page.inner_text("#recovery")
    assert "/ckpt/step-15" in p.page.inner_text("#checkpoints")
    assert p.js("vigil.heat.ratioAt(5, 20)") == pytest.approx(3.0)
    p.shot("job")
    # The cell of rank 5 at step 20 -> its drill-down beside the median rank.
    x, y = _cell_point(p, 5, 20)
    p.page.mouse.click(x, y)
    p.page.wait_for_selector("#drill[data-loaded='5:20']")
    assert "rank=5" in p.page.url and "step=20" in p.page.url
    phases = p.page.inner_text("#phase-table")
    assert "1.50 s" in phases and "\u00d73.00" in phases
    assert "all_reduce" in p.page.inner_text("#coll-table")
    p.shot("drill-down")
    with p.page.expect_download() as info:
        p.page.click("#perfetto")
    trace = json.loads(gzip.decompress(Path(info.value.path()).read_bytes()))
    steps = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "step"}
    assert steps == {f"step {s}" for s in range(18, 23)}
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(range(8))
    assert trace["otherData"]["job_id"] == "train-8"
    # A finding's click selects its cells and opens its first rank.
    p.page.click("#findings [data-finding='train-8-straggler']")
    p.page.wait_for_selector("#drill[data-loaded='5:10']")
    assert p.js("[...vigil.heat.selection.ranks]") == [5]
    # Deep link straight to a metric and cell; rows by node.
    p.page.goto(served.url + "/ui/jobs/train-8?metric=wait&step=12&rank=3")
    p.page.wait_for_selector("#drill[data-loaded='3:12']")
    assert p.js("vigil.heat.data.header.metric") == "wait"
    p.page.select_option("#heat-group", "node")
    p.until("vigil.heat.data.header.grouping === 'node'")
    assert [g["label"] for g in p.js("vigil.heat.data.header.groups")] == ["node-0", "node-1"]
    assert p.errors == [] and p.dialogs == []


def test_zoom_fetches_detail_of_a_large_job(served: Served, open_page: Callable[..., Page]) -> None:
    """1,200 ranks x 120 steps: the full view is downsampled keeping the one slow cell; a
    wheel zoom fetches a finer window; a click on a coarse cell resolves the slow rank."""
    ranks, steps = 1200, 120
    served.post([schema.Job(job_id="big", name="big", world_size=ranks)])
    for first in range(0, steps, 40):
        served.post(
            [
                rec.step(r, s, job="big", seconds=4.0 if (r, s) == (901, 77) else 0.5)
                for s in range(first, first + 40)
                for r in range(ranks)
            ]
        )
    p = open_page()
    p.page.goto(served.url + "/ui/jobs/big")
    p.page.wait_for_selector("canvas#heatmap[data-paints]")
    header = p.js("vigil.heat.data.header")
    assert header["rank_stride"] > 1 and header["num_rows"] <= 800
    assert p.js("vigil.heat.valueAt(901, 77)") == pytest.approx(4.0)
    x, y = _cell_point(p, 901, 77)
    p.page.mouse.move(x, y)
    assert "\u00d78.00" in p.page.inner_text("#tooltip")
    for _ in range(3):
        p.page.mouse.wheel(0, -300)
        time.sleep(0.05)
    p.until("vigil.heat.data.header.rank_stride === 1")
    zoomed = p.js("vigil.heat.data.header")
    assert zoomed["row_start"] > 0 or zoomed["row_end"] < ranks - 1
    p.page.click("#heat-reset")
    p.until("vigil.heat.data.header.rank_stride > 1")
    x, y = _cell_point(p, 901, 77)
    p.page.mouse.click(x, y)
    p.page.wait_for_selector("#drill[data-loaded='901:77']")
    assert p.errors == []


def test_live_update_without_reload(served: Served, open_page: Callable[..., Page]) -> None:
    served.post(
        [schema.Job(job_id="live", name="live", world_size=2), *rec.steps(2, 5, job="live")]
    )
    p = open_page()
    p.page.goto(served.url + "/ui/jobs/live")
    p.page.wait_for_selector("canvas#heatmap[data-paints]")
    assert p.page.inner_text("#fact-last-step") == "4"
    p.js("window.notReloaded = true")
    served.post(rec.steps(2, 5, job="live", first=5))
    p.page.wait_for_selector("#fact-last-step:text-is('9')", timeout=15_000)
    p.until("vigil.heat.data.header.step_end === 9")
    assert p.js("window.notReloaded") is True
    p.page.goto(served.url + "/ui/")
    p.page.wait_for_selector("a.job-link")
    served.post(
        [schema.Job(job_id="later", name="later", world_size=1), rec.step(0, 0, job="later")]
    )
    p.page.wait_for_selector("a.job-link:text-is('later')", timeout=15_000)
    assert p.errors == []


def test_names_and_stacks_cannot_inject_markup(
    served: Served, open_page: Callable[..., Page]
) -> None:
    job = "xss-" + XSS
    hang = schema.Finding(
        finding_id="hang-1",
        kind=schema.FindingKind.HANG,
        job_id=job,
        subjects=schema.Subjects(ranks=[1]),
        step_start=2,
        step_end=2,
        summary="<script>alert(2)</script> stuck",
        evidence=[
            schema.Evidence(metric="stack_group_ranks", observed=1, note=f"ranks [1]: {XSS}"),
        ],
        confidence=0.9,
        detected_s=1_700_000_010.0,
    )
    beats = [
        schema.Heartbeat(
            job_id=job,
            rank=r,
            time_s=1_700_000_003.0,
            last_step=2,
            last_group="world",
            last_seq=10 - r,
            last_op="all_reduce",
        )
        for r in range(2)
    ]
    served.post(
        [
            schema.Job(job_id=job, name=XSS, world_size=2),
            schema.RankInfo(job_id=job, rank=0, node=XSS, world_size=2),
            *rec.steps(2, 3, job=job),
            *beats,
            hang,
        ]
    )
    p = open_page()
    p.page.goto(served.url + "/ui/")
    p.page.wait_for_selector("a.job-link")
    assert XSS in p.page.inner_text("#jobs-table")
    p.page.click("a.job-link")
    p.page.wait_for_selector("#hang-matrix")
    assert p.page.inner_text("h1").startswith(XSS)
    assert XSS in p.page.inner_text("#hang")
    assert "<script>alert(2)</script> stuck" in p.page.inner_text("#findings")
    assert p.page.locator("#hang-matrix .behind").count() == 1  # rank 1 is behind in world
    p.page.select_option("#heat-group", "node")
    p.until("vigil.heat.data.header.grouping === 'node'")
    p.page.wait_for_timeout(300)
    assert p.page.locator("main img, main script").count() == 0
    assert p.dialogs == [] and p.errors == []
    p.shot("hang")


def test_read_token_is_asked_once_and_never_in_urls(
    tmp_path: Path, open_page: Callable[..., Page]
) -> None:
    served = Served(tmp_path, read_tokens=["read-secret"], ingest_tokens=["ingest-secret"])
    try:
        served.post(
            [schema.Job(job_id="auth", name="auth", world_size=1), rec.step(0, 0, job="auth")],
            "ingest-secret",
        )
        p = open_page()
        urls: list[str] = []
        headers: list[str] = []

        def seen(request: Any) -> None:
            urls.append(request.url)
            if "/ui/api/" in request.url:
                headers.append(request.headers.get("authorization", ""))

        p.page.on("request", seen)
        p.page.goto(served.url + "/ui/")
        p.page.wait_for_selector("#token-dialog[open]")
        p.page.fill("#token-input", "read-secret")
        p.page.click("#token-save")
        p.page.wait_for_selector("a.job-link")
        p.page.click("a.job-link")
        p.page.wait_for_selector("canvas#heatmap[data-paints]")
        assert p.js("sessionStorage.getItem('vigil.readToken')") == "read-secret"
        assert not any("read-secret" in u for u in urls)
        assert "Bearer read-secret" in headers
        # Only the first, tokenless request was refused (the browser logs that 401).
        assert [e for e in p.errors if "401" not in e] == []
        # A new tab of the same session is a new sessionStorage: asked again.
        fresh = open_page()
        fresh.page.goto(served.url + "/ui/jobs/auth")
        fresh.page.wait_for_selector("#token-dialog[open]")
        assert "needs a read token" in fresh.page.inner_text("#token-reason")
    finally:
        served.stop()


def test_a_real_jobs_straggler_stands_out(
    served: Served, open_page: Callable[..., Page], tmp_path: Path
) -> None:
    """4 gloo ranks run tests/realjobs/train.py shipping to the collector; rank 2 is 3x slow
    in forward from step 8. In compute time (step minus exposed wait) its row is the hot one:
    the value the page holds and the canvas pixel say so."""
    cases = [
        {
            "job": "real-straggler",
            "steps": 24,
            "seed": 3,
            "fault": {"kind": "slow", "rank": 2, "factor": 3.0, "where": "forward"},
        }
    ]
    result = launcher.launch("plain", cases, tmp_path / "out", collector=served.url, timeout_s=150)
    assert result.exit_codes == [0, 0, 0, 0], f"see {result.logs}"
    p = open_page()
    p.page.goto(served.url + "/ui/jobs/real-straggler?metric=compute")
    p.page.wait_for_selector("canvas#heatmap[data-paints]")
    p.until("vigil.heat.data.header.step_end >= 23")
    ratios = p.js("[0, 1, 2, 3].map(r => [12, 16, 20].map(s => vigil.heat.ratioAt(r, s)))")
    # Each column: the straggler's compute is over twice the median rank's and twice any
    # other rank's (the others' compute is short and noisy on shared CPUs: they mostly wait).
    for column in range(3):
        others = [ratios[r][column] for r in (0, 1, 3)]
        assert ratios[2][column] > 2.0 and ratios[2][column] > 2 * max(others), ratios
    pixels = p.js(
        """[0, 1, 2, 3].map(r => {
            const at = vigil.heat.pixelOf(r, 16), k = window.devicePixelRatio || 1;
            return Array.from(document.getElementById('heatmap').getContext('2d')
                .getImageData(Math.round(at.x * k), Math.round(at.y * k), 1, 1).data.slice(0, 3));
        })"""
    )
    red, green, _ = pixels[2]
    assert red > 240 and green < 60, pixels  # 2x the median or more: full red
    assert all(px[1] > 60 for r, px in enumerate(pixels) if r != 2), pixels
    # Its cell opens its phases beside the median rank's: the straggler waits least.
    x, y = _cell_point(p, 2, 16)
    p.page.mouse.click(x, y)
    p.page.wait_for_selector("#drill[data-loaded='2:16']")
    wait = p.page.locator("#phase-table tr", has_text="exposed comm wait").inner_text()
    assert float(wait.split("\u00d7")[1]) < 0.8, p.page.inner_text("#phase-table")
    p.shot("real-straggler")
    assert p.errors == []
