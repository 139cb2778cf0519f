"""The what-if panel in Chromium: refused without the presenter key, then run with it: the range and its
estimate before the replay, one Gantt per run, the per-user table with the change, downloads. Its
screenshot goes to tests/browser.py screenshot_dir()."""
import threading
import time
from pathlib import Path

import pytest

from tests.browser import ARGS, CHROMIUM, MARKS, screenshot_dir, served_ui

pytestmark = MARKS
KEY = "whatif-browser-key"


@pytest.fixture(scope="module")
def server():
    import httpx

    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="continuous", max_num_batched_tokens=32),
                   dict(presenter_key=KEY), max_tokens=8) as (url, service):
        with httpx.Client(base_url=url, timeout=300, trust_env=False) as http:     # two users, one after the other
            for user, text, n in (("Ann", "Count to five.", 8), ("Dan", "Summarise: " + "a red fox ran " * 10, 3)):
                body = {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0,
                        "user": user, "ignore_eos": True}
                threading.Thread(target=http.post, args=("/v1/chat/completions",), kwargs={"json": body}).start()
                time.sleep(0.3)
            while service.arrival_log.status()["ended"] < 2:
                time.sleep(0.2)
        yield url


def test_whatif_panel_replays_and_shows_each_user(server):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 1000}, accept_downloads=True)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server + "/")
        panel = page.locator("[data-testid=whatif]")
        panel.wait_for()
        status = panel.locator("[data-testid=whatif-status]")
        # the panel's buttons wear its own style, not the host theme's, which fades them between states (axe once
        # caught Replay mid-fade at 3.7:1): enabled and disabled at once, each above 4.5:1
        look = ("(() => { const c = getComputedStyle(document.querySelector('[data-testid=whatif-run]'));"
                " return [c.color, c.backgroundColor, c.transitionDuration]; })()")
        assert page.evaluate(look) == ["rgb(17, 17, 17)", "rgb(255, 255, 255)", "0s"], page.evaluate(look)
        page.evaluate("document.querySelector('[data-testid=whatif-run]').disabled = true")
        assert page.evaluate(look) == ["rgb(85, 85, 85)", "rgb(238, 238, 238)", "0s"], page.evaluate(look)
        page.evaluate("document.querySelector('[data-testid=whatif-run]').disabled = false")
        panel.locator("[data-testid=whatif-run]").click()        # no key: the server says no, the page says why
        page.wait_for_function("document.querySelector('[data-testid=whatif-status]').dataset.bad === '1'")
        assert "presenter key" in status.inner_text()

        page.evaluate(f"sessionStorage.setItem('batchscope.key', '{KEY}')")
        panel.locator("[data-whatif-policy=chunked]").check()
        panel.locator("[data-testid=whatif-budget]").fill("8")
        # the range to replay, estimated before it starts: nothing after a far step (Replay stays off), then
        # "since the last lesson" (no lesson pressed in this tab: where the newest setting began)
        estimate = panel.locator("[data-testid=whatif-estimate]")
        panel.locator("[data-testid=whatif-since]").fill("100000")
        panel.locator("[data-testid=whatif-since]").dispatch_event("change")
        page.wait_for_function("document.querySelector('[data-testid=whatif-estimate]').textContent"
                               ".includes('since step 100000')")
        assert "no finished request" in estimate.inner_text()
        assert panel.locator("[data-testid=whatif-run]").is_disabled()
        panel.locator("[data-testid=whatif-last-lesson]").click()
        page.wait_for_function("document.querySelector('[data-testid=whatif-estimate]').textContent"
                               ".startsWith('2 request(s) since step 0: about')")
        assert "(limit 240 s)" in estimate.inner_text() and not panel.locator("[data-testid=whatif-run]").is_disabled()
        # an estimate asked for earlier but answered later never replaces a newer one: the far step's answer
        # is held back 1.5 s, and "since the last lesson" is pressed meanwhile
        page.evaluate("(() => { const real = window.fetch; window.fetch = (u, o) =>"
                      " String(u).includes('since_step=100000')"
                      " ? new Promise((ok) => setTimeout(() => ok(real(u, o)), 1500)) : real(u, o); })()")
        panel.locator("[data-testid=whatif-since]").fill("100000")
        panel.locator("[data-testid=whatif-since]").dispatch_event("change")
        panel.locator("[data-testid=whatif-last-lesson]").click()
        page.wait_for_function("document.querySelector('[data-testid=whatif-estimate]').textContent"
                               ".startsWith('2 request(s) since step 0: about')")
        time.sleep(2.5)                                           # the held-back answer has landed by now
        assert estimate.inner_text().startswith("2 request(s) since step 0: about"), estimate.inner_text()
        panel.locator("[data-testid=whatif-run]").click()
        panel.locator("[data-testid=whatif-table]").wait_for(state="visible", timeout=600_000)
        assert panel.locator("figure.bs-whatif-gantt").count() == 2
        captions = panel.locator("figure.bs-whatif-gantt figcaption").all_inner_texts()
        assert captions[0].startswith("actual (continuous)") and "chunked, budget 8" in captions[1]
        rows = panel.locator("[data-testid=whatif-table] tr[data-user]")
        assert [rows.nth(i).get_attribute("data-user") for i in range(rows.count())] == ["Ann", "Dan"]
        assert "longest stall" in rows.nth(0).inner_text() and "->" in rows.nth(0).inner_text()
        assert "replayed 2 request(s)" in status.inner_text()

        with page.expect_download() as dl:
            panel.locator("[data-download=html]").click()
        report = Path(dl.value.path()).read_text()
        assert report.startswith("<!doctype html>") and "what-if 1: chunked, budget 8" in report

        panel.screenshot(path=str(screenshot_dir() / "ui_whatif.png"))
        browser.close()
    assert not errors, errors


def test_the_panel_follows_the_log_while_the_class_chats(server):
    """A lecturer who plays a lesson and then scrolls to the panel sees the log as it is, not as it was when
    the page loaded: while records arrive, the panel on screen asks again (every 2 s at most)."""
    import re

    import httpx
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(server + "/")
        page.evaluate(f"sessionStorage.setItem('batchscope.key', '{KEY}')")
        page.reload()
        panel = page.locator("[data-testid=whatif]")
        panel.scroll_into_view_if_needed()
        log = panel.locator("[data-testid=whatif-log]")
        page.wait_for_function("/\\d+ request/.test(document.querySelector('[data-testid=whatif-log]').textContent)")
        before = int(re.search(r"(\d+) request", log.inner_text()).group(1))
        body = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, "ignore_eos": True, "user": "Eve"}
        with httpx.Client(base_url=server, timeout=120, trust_env=False) as http:
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        # the lecturer keeps the panel on screen: Gradio may still be laying the page out (a loaded machine), and a
        # panel pushed below the fold rightly asks nothing, so each look of the wait brings it back into view
        page.wait_for_function("(n) => { const panel = document.querySelector('[data-testid=whatif]');"
                               "  panel.scrollIntoView({block: 'center'});"
                               "  return panel.querySelector('[data-testid=whatif-log]').textContent"
                               "    .includes(n + ' request'); }", arg=before + 1, timeout=20000)
        browser.close()
