"""One truth for every viewer: a page opened late shows the same per-setting metrics as one that
watched from the start, and both are app/readers/metrics.py's stretches() over the whole stream.

One real server on loopback (default model) that sends a new viewer only its last 6 steps. A
first page watches from the start; requests run under continuous batching (a long prompt
stalls two replies), then under chunked prefill; a second page opens after it all. The late
page's snapshot lacks the early steps, so its table must come from the server's per-setting
numbers (app/serving/broadcast.py), the early page's from its own records; each cell must hold, in
numbers and in text, what Python computes from every record the server published.
"""
import threading
import time

import pytest

from tests.browser import MARKS, api, live_page, served_ui, wait_js
from tests.page_table import TABLE_JS, check

pytestmark = MARKS


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="continuous"), {"snapshot_steps": 6}) as (url, service):
        yield url, service


def chat(url: str, text: str, n: int, started: threading.Event | None = None):
    """One chat completion; with `started`, streamed, and `started` is set at its first token."""
    import json
    import urllib.request
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": started is not None}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if started is not None and line.startswith(b"data: {"):
                started.set()


def traffic(url: str):
    """Two replies under way, then a long prompt arrives: under continuous it stalls them. The prompt is
    sent once both replies have their first token (a fixed delay raced them: on a fast CPU both could end
    before it), and each reply has 32 tokens to go, so it arrives mid-reply however fast the steps are."""
    doc = "Summarise this. " + "The lighthouse keeper climbed the stairs every evening at dusk. " * 40
    started = [threading.Event(), threading.Event()]
    jobs = [threading.Thread(target=chat, args=(url, q, 32, ev))
            for q, ev in zip(("Name a colour.", "Name a fruit."), started)]
    jobs.append(threading.Thread(target=lambda: ([ev.wait(120) for ev in started], chat(url, doc, 4))))
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(120)


def table(pg) -> list[dict]:
    wait_js(pg, "document.querySelector('[data-testid=metrics] tr[data-metric=steps] td')")
    return pg.evaluate(TABLE_JS)


def test_a_page_opened_late_shows_the_metrics_of_one_that_watched_from_the_start(server, browser):  # noqa: F811
    from app.readers import metrics
    url, service = server
    with live_page(browser, url, {"width": 1400, "height": 1000}) as early:
        traffic(url)
        api(url, "/api/engine", {"policy": "chunked"})
        traffic(url)
        with live_page(browser, url, {"width": 1400, "height": 1000}) as late:
            _, stream = service.ring.last_steps(service.config.history)
            steps = [r for r in stream if r["type"] == "step"]
            assert steps[0]["step"] == 0 and len(steps) > 20     # the whole run is still in the ring
            want_last = steps[-1]["step"]
            # both have taken in the last step; the late one the server's numbers after it too (it asks
            # for them once the steps stop)
            wait_js(early, f"BS.store.steps.length && BS.store.steps.at(-1).step === {want_last}")
            wait_js(late, f"BS.store.stretches && BS.store.stretches.at(-1).last_step === {want_last}")
            time.sleep(1.0)               # the table redraws at most twice a second
            assert late.evaluate("BS.store.steps[0].step") > 0 and not late.evaluate("BS.seenWhole()")
            assert early.evaluate("BS.seenWhole()")
            want = metrics.stretches(stream)
            assert [m["policy"] for m in want] == ["continuous", "chunked"] and want[0]["stall_max_s"] > 0
            early_cols, late_cols = table(early), table(late)
            check(early_cols, stream)
            check(late_cols, stream)
            assert early_cols == late_cols
