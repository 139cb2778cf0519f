"""The stage on a projector, in a real browser: at 1366x768 and 1920x1080, pressing a lesson brings
its caption, the chart and the whole batch bar into one screen, the chat panels sit beside the
chart (a lecturer types with the chart in view), and the lesson texts are folded to one line. The
projector view and a phone's /join fit their screens the same way.
Writes docs/ui_stage_1366.png, docs/ui_stage_1920.png, docs/ui_projector_1366.png,
docs/ui_projector_1920.png and docs/ui_join_phone.png.
"""

import pytest

from tests.browser import MARKS, api, conn_is, live_page, screenshot_dir, served_ui, wait_js

SIZES = [(1366, 768), (1920, 1080)]
pytestmark = MARKS


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    fast = {"static-vs-continuous": dict(reply_tokens=(6, 24, 8, 16, 6, 30, 4, 12))}
    with served_ui(EngineConfig(kv_cache_gb=0.25), {"step_delay": 0.05}, scenario_params=fast,
                   max_tokens=8) as (url, service):
        yield url


def box(pg, selector: str) -> dict:
    return pg.evaluate("(s) => { const r = document.querySelector(s).getBoundingClientRect();"
                       " return {x: r.left, y: r.top, w: r.width, h: r.height, bottom: r.bottom, right: r.right}; }",
                       selector)


def on_screen(b: dict, w: int, h: int) -> bool:
    return b["h"] > 0 and b["y"] >= -1 and b["bottom"] <= h + 1 and b["x"] >= -1 and b["right"] <= w + 1


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_pressed_lesson_shows_caption_chart_and_batch_bar_on_one_screen(server, browser, size):  # noqa: F811
    w, h = size
    with live_page(browser, server, {"width": w, "height": h}) as pg:
        # the lesson texts are folded to one line each until opened
        line = pg.evaluate("parseFloat(getComputedStyle(document.querySelector('#bs-lesson-text-1')).lineHeight)"
                           " || 24")
        for k in range(1, 6):
            assert box(pg, f"#bs-lesson-text-{k}")["h"] <= 2 * line + 4, k
        pg.click("#bs-lesson-1")
        wait_js(pg, "document.querySelector('[data-testid=lesson-caption]').dataset.lesson === '1'")
        wait_js(pg, "BS.store.steps.some(s => s.policy === 'static' && s.items.length >= 4)")
        pg.wait_for_timeout(1500)                           # the chart grows with its rows, then settles
        caption, gantt, bar = (box(pg, f"[data-testid={t}]") for t in ("lesson-caption", "gantt", "batch-bar"))
        for name, b in (("caption", caption), ("chart", gantt), ("batch bar", bar)):
            assert on_screen(b, w, h), (name, b, size)
        assert "Static batching" in pg.inner_text("[data-testid=lesson-caption]")
        assert "no chunk cap" in pg.inner_text("[data-testid=lesson-caption]")
        # a chat panel beside the chart, its box on screen at the same time
        chat = box(pg, "#bs-box-0")
        assert chat["x"] >= gantt["right"] - 1 and on_screen(chat, w, h), (chat, gantt)
        pg.screenshot(path=str(screenshot_dir() / f"ui_stage_{w}.png"))
        # every setting in force is on the page, the chunk cap with its clear button
        assert pg.input_value("[data-testid=chunk-cap]") == ""
        assert pg.is_disabled("[data-testid=chunk-cap-clear]")



def test_a_lesson_stopped_from_another_tab_says_so_in_its_caption(server, browser):  # noqa: F811
    """A lecturer's second tab (the laptop beside the projector's) presses a lesson while the first plays
    one: the first tab's caption stops naming its lesson, which no longer plays, and says why; and each
    caption, and the note under the lesson strip, is redrawn in the language the tab switches to."""
    from app.ui.text import t
    cap = "document.querySelector('[data-testid=lesson-caption]')"
    with live_page(browser, server, {"width": 1366, "height": 768}) as first, \
            live_page(browser, server, {"width": 1366, "height": 768}) as second:
        first.click("#bs-lesson-1")
        wait_js(first, "BS.store.steps.some(s => s.policy === 'static' && s.items.length >= 2)")
        assert "Static batching" in first.inner_text("[data-testid=lesson-caption]")
        second.click("#bs-lesson-1")
        wait_js(first, f"{cap}.textContent === {t('en', 'lesson_stopped')!r}")
        assert "Static batching" in second.inner_text("[data-testid=lesson-caption]")
        # the second tab's lesson plays on to its end (its 8 users finish), its caption unchanged; the
        # first's stays stopped
        wait_js(second, "(rs => rs.filter(r => r.endEvent === 'finished').length >= 8 && rs.every(r => r.end != null))"
                        "([...BS.store.reqs.values()])", timeout=60)
        assert "Static batching" in second.inner_text("[data-testid=lesson-caption]")
        assert first.inner_text("[data-testid=lesson-caption]") == t("en", "lesson_stopped")
        # each caption follows the language: Chinese, then English again
        for pg in (first, second):
            pg.click("#bs-lang label:has-text('中文')")
        wait_js(first, f"{cap}.textContent === {t('zh', 'lesson_stopped')!r}")
        wait_js(second, f"{cap}.textContent.includes('静态批处理')")
        # and so does the note under the lesson strip: why the lesson stopped, the settings it set
        in_force = lambda lang: t(lang, "in_force", setting="").strip()
        note = "document.querySelector('#bs-note').innerText.trim()"
        wait_js(first, f"{note} === {t('zh', 'lesson_stopped')!r}")
        wait_js(second, f"{note}.startsWith({in_force('zh')!r})")
        second.click("#bs-lang label:has-text('English')")
        wait_js(second, f"{cap}.textContent.includes('Static batching')")
        wait_js(second, f"{note}.startsWith({in_force('en')!r})")

def test_the_chunk_cap_shows_and_clears_from_the_page(server, browser):  # noqa: F811
    with live_page(browser, server, {"width": 1366, "height": 768}) as pg:
        api(server, "/api/engine", {"max_prefill_chunk": 4})
        pg.reload()
        cap = "(document.querySelector('[data-testid=chunk-cap]') || {}).value"
        wait_js(pg, f"{cap} === '4'")
        assert not pg.is_disabled("[data-testid=chunk-cap-clear]")
        pg.click("[data-testid=chunk-cap-clear]")
        wait_js(pg, f"{cap} === ''")
        assert api(server, "/api/engine")["max_prefill_chunk"] is None


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_projector_fits_its_screen_and_shows_every_setting(server, browser, size):  # noqa: F811
    w, h = size
    ctx = browser.new_context(viewport={"width": w, "height": h})
    pg = ctx.new_page()
    try:
        pg.goto(server + "/projector")
        wait_js(pg, conn_is("live"))
        # the test makes its own steps: it may run alone, first, or on a worker of its own
        api(server, "/v1/chat/completions", {"max_tokens": 4, "user": "Projector",
                                             "messages": [{"role": "user", "content": "Say hi."}]})
        wait_js(pg, "document.querySelector('[data-testid=metrics] tr[data-metric=steps] td')")
        # the chart gives up room the metrics table takes (a smaller chart waits 1.5 s, so it does not jump)
        try:
            wait_js(pg, f"document.documentElement.scrollHeight <= {h + 2}", timeout=10)
        except Exception:
            pg.screenshot(path=str(screenshot_dir() / f"ui_projector_{w}_too_tall.png"), full_page=True)
            raise AssertionError((pg.evaluate("document.documentElement.scrollHeight"), size))
        for t in ("gantt", "batch-bar", "metrics", "join-box"):
            assert on_screen(box(pg, f"[data-testid={t}]"), w, h), (t, size)
        # the metrics table is not cut off sideways: every column of the comparison is in view
        m = box(pg, "[data-testid=metrics] table")
        assert m["right"] <= w + 1
        assert pg.evaluate("(() => { const e = document.querySelector('[data-testid=metrics]');"
                           " return e.scrollWidth <= e.clientWidth + 1; })()")
        # the server listens on loopback only: phones cannot reach it, and the page says so
        warn = pg.inner_text("[data-testid=join-warning]")
        assert "--host 0.0.0.0" in warn
        pg.screenshot(path=str(screenshot_dir() / f"ui_projector_{w}.png"))
    finally:
        ctx.close()


def test_join_on_a_phone_fits_the_screen(server, browser):  # noqa: F811
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                              device_scale_factor=2)
    pg = ctx.new_page()
    try:
        pg.goto(server + "/join")
        wait_js(pg, conn_is("live"))
        pg.fill("[data-testid=student-name]", "Ann")
        pg.click("[data-testid=join]")
        wait_js(pg, "!document.querySelector('[data-testid=you-are]').hidden")
        pg.fill("[data-testid=student-box]", "Say hi.")
        pg.click("[data-testid=student-send]")
        wait_js(pg, "[...BS.store.reqs.values()].some(r => r.label === 'Ann' && r.end != null)")
        pg.wait_for_timeout(1000)
        assert pg.evaluate("document.documentElement.scrollWidth") <= 391       # nothing runs off sideways
        assert pg.evaluate("(() => { const e = document.querySelector('[data-testid=metrics]');"
                           " return e.scrollWidth <= e.clientWidth + 1; })()")
        labels = pg.evaluate("[...document.querySelectorAll('[data-testid=row-labels] li')].map(l => l.textContent)")
        assert any(x.startswith("you: Ann") for x in labels), labels
        pg.screenshot(path=str(screenshot_dir() / "ui_join_phone.png"), full_page=True)
    finally:
        ctx.close()


def test_a_slow_step_after_a_setting_change_keeps_its_duration_and_a_running_step_counts(browser):  # noqa: F811
    """Lesson 2 after a chunked setting: the setting flag and the 10 s prefill share a column; the
    duration sits on the column, drawn after the flag. Then no step comes for 3 s while a reply is
    under way: the chart says a step is running, and for how long."""
    from tests.browser import load_stage
    from tests.factories import arrived, dec, pre, step
    s, t = [arrived("a", 0.0), arrived("d", 0.4)], 0.0
    for i in range(10):
        s.append(step(i, t, t + 0.05, [pre("a", 8, 0, 8)] if i == 0 else [dec("a")]))
        t += 0.05
    s.append(step(10, t, t + 10.0, [pre("d", 1500, 0, 1500)], stalled=["a"], policy="continuous"))
    t += 10.0
    for i in range(11, 16):
        s.append(step(i, t, t + 0.05, [dec("a"), dec("d")], policy="continuous"))
        t += 0.05
    pg = browser.new_page(viewport={"width": 1366, "height": 768})
    try:
        load_stage(pg, s)
        wait_js(pg, "BS.view.drawn && BS.view.drawn.slow && BS.view.drawn.slow.length")
        drawn = pg.evaluate("({slow: BS.view.drawn.slow, markers: BS.view.drawn.markers.map(m => m.step)})")
        assert 10 in drawn["markers"]
        box = drawn["slow"][0].pop("box")           # where its ink lies, in drawing units
        assert drawn["slow"] == [{"step": 10, "text": "10.00 s", "shown": True, "x": drawn["slow"][0]["x"], "y": 26}]
        assert box["h"] == 18 and box["w"] > 30 and box["y"] * pg.evaluate("BS.chartScale") == 26
        # live again, the newest step 3 s old, a reply still under way: "step running… 3.0 s"
        pg.evaluate("""() => { BS.offline = false; BS.store.connected = true;
                               BS.store.lastStepAt = performance.now() - 3000; BS.redrawChart(); }""")
        wait_js(pg, "BS.view.drawn.running && BS.view.drawn.running.seconds >= 3")
        assert pg.evaluate("BS.view.drawn.running.text").startswith("step running… 3.")
    finally:
        pg.close()


def test_the_projector_names_the_lesson_playing_and_one_opened_late_does_too(server, browser):  # noqa: F811
    """The lecturer presses a lesson on the laptop: the projector names it over its chart while it plays, a
    projector opened meanwhile does too (its snapshot says which), and both say it was just played once it
    ended (the chart still shows its steps)."""
    from app.ui.text import STRINGS
    title = "1 · Static batching."                      # the bold lead of lesson 1's words
    now, ended = (STRINGS["en"][k].format(title=title) for k in ("lesson.now", "lesson.ended"))
    named = "document.querySelector('[data-testid=lesson-now]')"
    contexts = []

    def projector():
        ctx = browser.new_context(viewport={"width": 1366, "height": 768})
        contexts.append(ctx)
        pg = ctx.new_page()
        pg.goto(server + "/projector")
        wait_js(pg, conn_is("live"))
        return pg

    try:
        with live_page(browser, server, {"width": 1366, "height": 768}) as lecturer:
            first = projector()
            lecturer.click("#bs-lesson-1")
            wait_js(first, f"!{named}.hidden && {named}.textContent === {now!r}")
            late = projector()
            wait_js(late, f"[{now!r}, {ended!r}].includes({named}.textContent)")
            assert lecturer.is_hidden("[data-testid=lesson-now]")        # the lecturer has the caption
            # a second lecturer tab, where no lesson was pressed, names it as the projector does
            with live_page(browser, server, {"width": 1366, "height": 768}) as laptop:
                wait_js(laptop, f"[{now!r}, {ended!r}].includes({named}.textContent) && !{named}.hidden")
            for pg in (first, late):
                wait_js(pg, f"{named}.dataset.event === 'ended' && {named}.textContent === {ended!r}", timeout=60)
            # a title in place of the chart's reading hint: the projector still fits its screen
            wait_js(first, "document.documentElement.scrollHeight <= 770", timeout=10)
            first.screenshot(path=str(screenshot_dir() / "ui_projector_lesson.png"))
    finally:
        for ctx in contexts:
            ctx.close()
