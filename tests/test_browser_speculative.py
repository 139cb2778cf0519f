"""The speculative lesson in the live page on the default model: drafts drawn kept and rejected while it runs,
and, when it ends, its note gives the numbers of its own records (app/ui/lessons.py speculation_result)."""
from __future__ import annotations

import pytest

from app.replay.scenarios import LESSONS
from tests.browser import MARKS, live_page, screenshot_dir, served_ui, wait_js

pytestmark = MARKS
K = len(LESSONS)                    # the speculative lesson is the last


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="chunked", cpu_threads=1)) as (url, service):
        yield url, service
    service.stop()


def test_the_speculative_lesson_draws_its_drafts_and_ends_with_its_numbers(server, browser):  # noqa: F811
    from app.ui.lessons import speculation_result
    url, service = server
    assert LESSONS[-1].scenario == "speculative-room"
    with live_page(browser, url, {"width": 1366, "height": 768}) as page:
        start = page.evaluate("BS.store.steps.length ? BS.store.steps.at(-1).step + 1 : 0")
        page.click(f"#bs-lesson-{K}")
        # the second pass, mid-run: the room has joined and its decodes verify drafts
        drafting = (f"BS.store.steps.filter(s => s.step >= {start} && s.items.filter(i => i.drafted).length >= 8)"
                    ".length >= 3")
        wait_js(page, drafting, timeout=300)
        page.evaluate("() => document.querySelector('[data-testid=stage] .bs-chart').scrollIntoView()")
        page.screenshot(path=str(screenshot_dir() / "ui_lesson8_speculative.png"))
        wait_js(page, "document.querySelector('#bs-note').textContent.includes('Measured in this run')", timeout=300)
        note = page.inner_text("#bs-note")
    runs = {}
    for r in service.ring.last_steps(service.config.history)[1]:
        if r.get("type") == "policy":
            runs.setdefault("passes", []).append(r)
    _, stream = service.ring.last_steps(service.config.history)
    labels = {e["req"]: e["label"] for e in stream if e.get("type") == "request" and e["event"] == "arrived"}
    firsts = [r["step"] for r in runs["passes"][-2:]]
    reqs_of = lambda lo, hi: {i["req"] for s in stream if s.get("type") == "step" and lo <= s["step"] < hi
                              for i in s["items"] if i["req"] in labels}
    off, on = reqs_of(firsts[0], firsts[1]), reqs_of(firsts[1], 10**9)
    assert len(off) == len(on) == 16
    want = speculation_result(stream, off, on)("en")
    assert want.replace("**", "") in note.replace("**", ""), (want, note)
