"""What the browser tests share: Debian's Chromium driven by Playwright, and the whole app (engine,
API, page) served on a free loopback port. Playwright's own browser download is not used."""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Debian's Chromium: its headless shell (package chromium-headless-shell, the build Playwright itself runs
# headless) where it is installed, as it spends about a fifth less CPU on the same pages as the whole browser
# in its headless mode (docs/results.md, the test suite); else the whole browser. The same Blink draws both.
SHELL, FULL = Path("/usr/bin/chromium-headless-shell"), Path("/usr/bin/chromium")
CHROMIUM = SHELL if SHELL.exists() else FULL
MARKS = [pytest.mark.browser,
         pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's Chromium (chromium-headless-shell or "
                                                          "chromium) is not installed; browser tests need it")]
STAGE_ORIGIN = "http://stage.test"       # load_stage: no server, Playwright answers
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@lru_cache(maxsize=None)
def screenshot_dir() -> Path:
    """Where the browser tests save their screenshots: BATCHSCOPE_SCREENSHOT_DIR when set
    (`BATCHSCOPE_SCREENSHOT_DIR=docs` refreshes the pictures the docs show); under pytest the conftest
    sets it to the run's temporary folder, one per worker, so that a test run rewrites no tracked file,
    parallel workers share none and old runs' pictures are cleaned up. Outside pytest: a new temporary
    folder."""
    chosen = os.environ.get("BATCHSCOPE_SCREENSHOT_DIR")
    folder = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="batchscope-shots-"))
    folder = folder if folder.is_absolute() else ROOT / folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def chromium():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def served_ui(engine_config, server_options: dict | None = None, mount=None, **mount_options):
    """The app with its page (app.ui.page.mount_ui(**mount_options), or `mount(app, service)`, such as
    app.ui.plain_page.mount_plain) on a free 127.0.0.1 port, served by uvicorn in a thread. Yields
    (url, service); the server stops when the block ends."""
    import uvicorn

    from app.api.server import create_app
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from app.ui.page import mount_ui

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = EngineService(engine_config, ServerConfig(port=port, **(server_options or {})))
    app = create_app(service)
    (mount or mount_ui)(app, service, **mount_options)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 300
    while not srv.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.2)
    try:
        yield f"http://127.0.0.1:{port}", service
    finally:
        srv.should_exit = True
        thread.join(60)
        # the app's lifespan stopped the engine thread; Gradio keeps the page's blocks (and so the service)
        # alive after the server, so let go of the engine here: its model would stay in this worker otherwise
        service.loop.engine = None


def conn_is(state: str) -> str:
    """JS: the page's connection badge says `state` ('live', 'lost'); false, not an error, while the page
    has not rendered the stage yet (Gradio draws it after main.js has run)."""
    return f"document.querySelector('[data-testid=conn]')?.dataset.state === '{state}'"


@contextmanager
def live_page(browser, url: str, viewport: dict):
    """The served page, connected to the live stream; no script error may happen while it is open."""
    ctx = browser.new_context(viewport=viewport)
    pg = ctx.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(url + "/")
    pg.wait_for_selector("[data-testid=gantt]")
    pg.wait_for_function(conn_is("live"))
    yield pg
    ctx.close()
    assert not errors, errors


def load_stage(pg, stream: list[dict], ready: str = "window.BS && BS.store"):
    """The page's stage alone (no server, offline mode), fed `stream` through BS.ingestAll as a trace
    file would be; `ready` is waited for before the stream goes in. The page and static/ (its modules)
    are served by Playwright's router at a made-up origin: modules load from URLs, not from strings."""
    from app.ui.assets import STATIC_URL, head_html, stage_html
    body = (f"<html><head><script>window.BS = {{offline: true}};</script>{head_html()}</head>"
            f"<body>{stage_html()}</body></html>")

    def serve(route):
        path = urlparse(route.request.url).path
        if path.startswith(STATIC_URL + "/"):
            route.fulfill(path=ROOT / "static" / path[len(STATIC_URL) + 1:])
        else:
            route.fulfill(body=body, content_type="text/html; charset=utf-8")
    pg.unroute(STAGE_ORIGIN + "/**")        # a page loaded again keeps one handler, not one per load
    pg.route(STAGE_ORIGIN + "/**", serve)
    pg.goto(STAGE_ORIGIN + "/")
    pg.wait_for_function(ready)
    pg.evaluate("(s) => BS.ingestAll(s)", stream)


# ---- axe-core: the automated WCAG checks (tests/test_browser_a11y.py) ----
AXE_VERSION = "4.10.3"                          # npm axe-core, pinned: a new rule would fail old pages
AXE_DIR = ROOT / ".axe"                         # git-ignored; scripts/test.sh fills it where npm is present
AXE_JS = AXE_DIR / "node_modules" / "axe-core" / "axe.min.js"
AXE_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]


def install_axe() -> Path:
    """axe.min.js of AXE_VERSION under AXE_DIR, installed by npm when missing or of another version."""
    import json
    import shutil
    import subprocess
    meta = AXE_JS.parent / "package.json"
    if AXE_JS.exists() and json.loads(meta.read_text()).get("version") == AXE_VERSION:
        return AXE_JS
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"axe-core {AXE_VERSION} is not in {AXE_DIR.name}/ and npm is not installed to fetch it")
    AXE_DIR.mkdir(exist_ok=True)
    subprocess.run([npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(AXE_DIR),
                    f"axe-core@{AXE_VERSION}"], check=True, capture_output=True, timeout=600)
    return AXE_JS


def axe_violations(pg, context: str = "document") -> list[dict]:
    """axe-core's WCAG 2.0/2.1 A and AA rules run on the open page (axe.min.js injected first); each
    violation as {id, impact, help, nodes: [{target: selector, summary: what fails there}, ...]}."""
    if not pg.evaluate("typeof window.axe === 'object'"):
        pg.add_script_tag(path=str(install_axe()))
    return pg.evaluate(r"""async ([ctx, tags]) => {
        const r = await axe.run(ctx === 'document' ? document : ctx, {runOnly: {type: 'tag', values: tags},
                                                                      resultTypes: ['violations']});
        return r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
            nodes: v.nodes.map(n => ({target: n.target.join(' '),
                                      summary: (n.failureSummary || '').replace(/\s+/g, ' ')}))}));
    }""", [context, AXE_TAGS])


def describe_violations(violations: list[dict]) -> str:
    """One line per node: rule id, impact, selector, what is wrong."""
    return "\n".join(f"{v['id']} ({v['impact']}) {n['target']}: {n['summary']}"
                     for v in violations for n in v["nodes"])


def api(server: str, path: str, body=None, headers=None):
    """A JSON call to the served app (GET, or POST when there is a body)."""
    import json
    import urllib.request
    req = urllib.request.Request(server + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def wait_js(pg, expr, timeout=120):
    pg.wait_for_function(expr, timeout=timeout * 1000)
