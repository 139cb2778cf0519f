"""WCAG 2.1 AA in a real browser (docs/ui.md: accessibility). axe-core's WCAG 2.0/2.1 A and AA rules
(tests/browser.py axe_violations: npm axe-core, pinned, injected by Playwright) find nothing on the
lecturer's page, the what-if panel, /join, /projector and /leaderboard, idle, during lesson 2 and after
it; a failure lists every violation (rule, element, what is wrong).
"""
import json

import pytest

from tests.browser import (
    AXE_JS,
    MARKS,
    axe_violations,
    conn_is,
    describe_violations,
    install_axe,
    live_page,
    load_stage,
    screenshot_dir,
    served_ui,
    wait_js,
)
from tests.colour_vision import CVD, ciede2000, contrast, hex_rgb, simulate, svg_matrix
from tests.factories import step
from tests.test_colour_vision import NEIGHBOURS_APART

pytestmark = MARKS
KEY = "a11y-presenter-key"
# lesson 2, short enough for a test: a ~300-token document (still three chunks of the lesson's budget)
STALL = dict(reply_tokens=16, doc_tokens=2, doc_at=8, doc_paragraphs=3)


@pytest.fixture(scope="session", autouse=True)
def axe_installed():
    """axe-core where the tests look for it (scripts/test.sh installs it first where npm is present)."""
    install_axe()
    assert AXE_JS.exists()


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="chunked"), dict(presenter_key=KEY, step_delay=0.03),
                   max_tokens=8, doc_max_tokens=2, scenario_params={"long-prompt-interrupts": STALL}) as (url, _):
        yield url


def no_violations(pg, where: str, context: str = "document"):
    found = axe_violations(pg, context)
    assert not found, f"{where}: {sum(len(v['nodes']) for v in found)} violations\n{describe_violations(found)}"


# JS: steps have been drawn and a request is still under way
RUNNING = "BS.store.steps.length > 3 && [...BS.store.reqs.values()].some(r => r.end == null)"

ALL_ENDED = "BS.store.reqs.size > 0 && [...BS.store.reqs.values()].every(r => r.end != null)"


def open_room_page(browser, url: str, viewport: dict):
    ctx = browser.new_context(viewport=viewport)
    pg = ctx.new_page()
    pg.goto(url)
    wait_js(pg, conn_is("live"))
    return ctx, pg


def test_the_lecturers_page_and_the_what_if_panel_idle_during_and_after_lesson_2(server, browser):
    with live_page(browser, server, {"width": 1366, "height": 900}) as pg:
        no_violations(pg, "/ idle")
        pg.click("#bs-lesson-2")
        wait_js(pg, RUNNING)
        no_violations(pg, "/ during lesson 2")
        wait_js(pg, ALL_ENDED)
        pg.wait_for_timeout(800)                       # Gradio's last update of the replies
        no_violations(pg, "/ after lesson 2")
        # the what-if panel with its results: the lesson replayed under another budget
        pg.evaluate(f"sessionStorage.setItem('batchscope.key', {json.dumps(KEY)})")
        panel = pg.locator("[data-testid=whatif]")
        panel.locator("[data-whatif-policy=chunked]").check()
        panel.locator("[data-testid=whatif-budget]").fill("128")
        panel.locator("[data-testid=whatif-last-lesson]").click()
        wait_js(pg, "!document.querySelector('[data-testid=whatif-run]').disabled")
        panel.locator("[data-testid=whatif-run]").click()
        panel.locator("[data-testid=whatif-table]").wait_for(state="visible", timeout=300_000)
        # the table is drawn a moment before the run ends and Run is enabled again (static/whatif.js)
        wait_js(pg, "!document.querySelector('[data-testid=whatif-run]').disabled")
        no_violations(pg, "the what-if panel with results", "[data-testid=whatif]")
        no_violations(pg, "/ after the what-if replay")


def test_join_and_the_projector_idle_during_and_after_a_lesson(server, browser):
    phone = {"width": 390, "height": 844}
    join_ctx, join = open_room_page(browser, server + "/join", phone)
    proj_ctx, proj = open_room_page(browser, server + "/projector", {"width": 1366, "height": 768})
    try:
        no_violations(join, "/join idle")
        no_violations(proj, "/projector idle")
        join.fill("[data-testid=student-name]", "Ann")
        join.click("[data-testid=join]")
        wait_js(join, "!document.querySelector('[data-testid=you-are]').hidden")
        no_violations(join, "/join joined")
        with live_page(browser, server, {"width": 1366, "height": 900}) as lecturer:
            lecturer.evaluate(f"sessionStorage.setItem('batchscope.key', {json.dumps(KEY)})")   # the presenter's
            lecturer.click("#bs-lesson-2")
            join.fill("[data-testid=student-box]", "Say hi.")
            join.click("[data-testid=student-send]")
            wait_js(proj, RUNNING)
            for pg in (proj, join):             # the lesson playing is named over their chart, and checked
                wait_js(pg, "!document.querySelector('[data-testid=lesson-now]').hidden")
            no_violations(proj, "/projector during lesson 2")
            no_violations(join, "/join during lesson 2")
            wait_js(lecturer, ALL_ENDED)
        wait_js(join, "[...BS.store.reqs.values()].some(r => r.label === 'Ann' && r.end != null)")
        no_violations(join, "/join after lesson 2")
        no_violations(proj, "/projector after lesson 2")
    finally:
        join_ctx.close()
        proj_ctx.close()


@pytest.fixture(scope="module")
def arena_report(tmp_path_factory):
    from app.cli import main as cli
    d = tmp_path_factory.mktemp("a11y-lb")
    subs = d / "subs"
    subs.mkdir()
    (subs / "spf.py").write_text(open("demos/arena/policies/shortest_prompt_first.py").read())
    # a given step cost, as test_browser_leaderboard.py: the report is the same page, without measuring one
    assert cli(["arena", "--rank", str(subs), "--workload", "chat-burst", "--scale", "0.25",
                "--cost", "0.01,0.0005,0.000001", "--out", str(d / "arena.html")]) == 0
    return d / "arena.json"


def test_the_leaderboard_empty_ranked_and_replaying(server, browser, arena_report):
    ctx = browser.new_context(viewport={"width": 1300, "height": 1000})
    pg = ctx.new_page()
    try:
        pg.goto(server + "/leaderboard")
        pg.wait_for_selector("[data-testid=lb-file]")
        no_violations(pg, "/leaderboard empty")
        pg.set_input_files("[data-testid=lb-file]", str(arena_report))
        pg.wait_for_selector("table[data-workload=chat-burst]")
        no_violations(pg, "/leaderboard ranked")
        pg.click("[data-testid=lb-replay][data-workload=chat-burst]")
        pg.wait_for_function("document.querySelector('[data-testid=lb-chart]').dataset.replayed === 'chat-burst'")
        chart = next(f for f in pg.frames if "leaderboard/chart" in f.url)
        chart.wait_for_function("window.BS && BS.store && BS.store.steps.length > 0 && BS.perf.draws > 0")
        no_violations(pg, "/leaderboard replaying")
    finally:
        ctx.close()


def test_axe_finds_what_it_is_asked_to_find(browser):
    """The check itself: a page with a known failure (grey on white, 2.3:1) is reported, with its element."""
    pg = browser.new_page()
    try:
        pg.set_content('<html lang="en"><head><title>t</title></head><body><main>'
                       '<p id="faint" style="color:#aaa;background:#fff">faint text</p></main></body></html>')
        found = axe_violations(pg)
        assert [v["id"] for v in found] == ["color-contrast"], found
        assert found[0]["nodes"][0]["target"] == "#faint"
        assert "contrast" in describe_violations(found)
    finally:
        pg.close()


# ---- colour is never alone (1.4.1, 1.4.11): the chart under colour-vision filters ----

def user_stream(names: list[str], n_steps: int = 14) -> list[dict]:
    """Each user decoding in every step, one row each, in slot order."""
    out = [{"type": "request", "event": "arrived", "req": f"r{i}", "label": n, "t": 0.0} for i, n in enumerate(names)]
    for k in range(n_steps):
        items = [{"req": f"r{i}", "label": n, "kind": "decode", "tokens": 1, "start": 10 + k}
                 for i, n in enumerate(names)]
        out.append(step(k, 0.1 * k, 0.1 * k + 0.09, items))
    return out


def cell_colour(png: bytes, cell: dict) -> tuple[int, int, int]:
    """The colour most of a cell's inside shows in a screenshot of the Gantt (device scale 1)."""
    from collections import Counter
    from io import BytesIO

    from PIL import Image
    img = Image.open(BytesIO(png)).convert("RGB")
    x0, y0 = round(cell["x"]) + 2, round(cell["y"]) + 2
    box = img.crop((x0, y0, x0 + max(1, round(cell["w"]) - 4), y0 + max(1, round(cell["h"]) - 4)))
    return tuple(Counter(box.tobytes()[i:i + 3] for i in range(0, box.width * box.height * 3, 3)).most_common(1)[0][0])


def test_neighbouring_rows_stay_apart_under_deuteranopia_and_protanopia_filters(browser):
    from app.ui.text import USERS
    names = [n for n, _ in USERS]
    pg = browser.new_page(viewport={"width": 1366, "height": 900})
    try:
        load_stage(pg, user_stream(names))
        pg.wait_for_function(f"BS.view.drawn && new Set(BS.view.drawn.cells.map(c => c.label)).size === {len(names)}")
        # one cell per user in one step, rows top to bottom: neighbours are the rows next to each other
        cells = pg.evaluate("""() => { const cs = BS.view.drawn.cells, last = Math.max(...cs.map(c => c.step));
                                       return cs.filter(c => c.step === last - 2).sort((a, b) => a.y - b.y); }""")
        assert [c["label"] for c in cells] == names
        defs = "".join(f'<filter id="bs-{k}" color-interpolation-filters="linearRGB"><feColorMatrix type="matrix" '
                       f'values="{svg_matrix(k)}"/></filter>' for k in CVD)
        pg.evaluate("(d) => document.body.insertAdjacentHTML('beforeend', "
                    "`<svg width='0' height='0' style='position:absolute' aria-hidden='true'>${d}</svg>`)", defs)
        gantt, chart = pg.locator("[data-testid=gantt]"), pg.locator(".bs-chart")
        seen = [cell_colour(gantt.screenshot(), c) for c in cells]
        assert seen == [hex_rgb(c) for _, c in USERS]                  # unfiltered: the palette itself
        # every mark's edge reaches 3:1 against each background a row can have (WCAG 1.4.11)
        for name, colour in USERS:
            edge = pg.evaluate("(c) => BS.edgeOf(c)", colour)
            backs = pg.evaluate("BS.BACKGROUNDS()")
            for back in backs:
                back = back if len(back) == 7 else "#" + "".join(ch * 2 for ch in back[1:])
                assert contrast(hex_rgb(edge), hex_rgb(back)) >= 3, (name, edge, back)
        for kind in CVD:
            pg.evaluate("(k) => { document.querySelector('.bs-chart').style.filter = `url(#bs-${k})`; }", kind)
            pg.wait_for_timeout(100)
            seen = [cell_colour(gantt.screenshot(), c) for c in cells]
            for (name, colour), got in zip(USERS, seen):     # the filter is the matrix the arithmetic uses
                assert ciede2000(got, simulate(hex_rgb(colour), kind)) < 3, (kind, name, got)
            for i in range(len(seen) - 1):
                d = ciede2000(seen[i], seen[i + 1])
                assert d >= NEIGHBOURS_APART, f"{kind}: rows {names[i]} and {names[i + 1]} only {d:.1f} apart"
            chart.screenshot(path=str(screenshot_dir() / f"ui_palette_{kind}.png"))
    finally:
        pg.close()


# ---- the chart as text (1.1.1, 4.1.3): a table of the last steps and a polite live region ----

def lesson2_stream() -> list[dict]:
    """Alice, Bob and Carol replying; Doc's long prompt read in 128-token chunks beside them (chunked), then
    one whole-prompt step of Eve's that leaves Alice out for 1.2 s (continuous)."""
    names = ["Alice", "Bob", "Carol"]
    out = [{"type": "request", "event": "arrived", "req": f"r{i}", "label": n, "t": 0.0} for i, n in enumerate(names)]
    out.append({"type": "request", "event": "arrived", "req": "r3", "label": "Doc", "t": 0.0, "prompt_len": 640})
    t = 0.0
    for k in range(14):
        items = [{"req": f"r{i}", "label": n, "kind": "decode", "tokens": 1, "start": 20 + k}
                 for i, n in enumerate(names)]
        dt, stalled = 0.05, []
        if 3 <= k < 8:
            items.append({"req": "r3", "label": "Doc", "kind": "prefill", "tokens": 128, "start": 128 * (k - 3),
                          "prompt_len": 640, "completes_prompt": k == 7})
        if k == 12:
            items, dt, stalled = [{"req": "r4", "label": "Eve", "kind": "prefill", "tokens": 300, "start": 0,
                                   "prompt_len": 300, "completes_prompt": True}], 1.2, ["r0"]
        out.append(step(k, t, t + dt, items, stalled=stalled))
        t += dt
    return out


def test_the_chart_reads_as_a_table_and_a_live_region_in_both_languages(browser):
    pg = browser.new_page(viewport={"width": 1366, "height": 900})
    try:
        stream = lesson2_stream()
        load_stage(pg, stream[:-2])           # up to step 11: Doc's last chunk was step 7
        live = "document.querySelector('[data-testid=chart-live]')"
        pg.wait_for_function(f"{live}.textContent.startsWith('step 11:')")
        assert pg.inner_text("[data-testid=chart-live]") == "step 11: 3 replies"
        pg.evaluate("(s) => BS.ingestAll(s)", stream[-2:])
        pg.wait_for_function(f"{live}.textContent.startsWith('step 13:')", timeout=5000)
        # each step in words, from its record
        said = pg.evaluate("(s) => s.map(BS.describeStep)", [r for r in stream if r["type"] == "step"])
        assert said[5] == "step 5: Doc's prompt chunk of 128 tokens beside 3 replies"
        assert said[12] == "step 12: Eve's whole prompt of 300 tokens; Alice waited 1.20 s"
        assert pg.get_attribute("[data-testid=chart-live]", "aria-live") == "polite"
        # the table: the last 12 steps, one column per request, each cell that request's part
        table = pg.evaluate("""() => [...document.querySelectorAll('[data-testid=chart-table] tr')]
                               .map(tr => [...tr.children].map(c => c.textContent))""")
        steps = [r for r in stream if r["type"] == "step"][-12:]
        assert table[0] == ["step", "duration", "Alice", "Bob", "Carol", "Doc", "Eve"]
        assert [int(r[0]) for r in table[1:]] == [s["step"] for s in steps]
        for row, s in zip(table[1:], steps):
            parts = {it["label"]: ("decode 1" if it["kind"] == "decode" else f"prefill {it['tokens']}")
                     for it in s["items"]}
            parts.update({"Alice": "stalled"} if s["stalled"] else {})
            assert row[2:] == [parts.get(n, "") for n in table[0][2:]], (s["step"], row)
            ms = (s["t_end"] - s["t_start"]) * 1000
            assert row[1] == (f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.2f} s")
        # hidden until asked for, then shown to everyone: the keyboard opens it
        box = pg.locator("[data-testid=chart-table-box]")
        assert box.bounding_box()["height"] <= 1
        pg.focus("[data-testid=table-toggle]")
        pg.keyboard.press("Enter")
        pg.wait_for_function("document.querySelector('[data-testid=table-toggle]')"
                             ".getAttribute('aria-expanded') === 'true'")
        assert box.bounding_box()["height"] > 200
        no_violations(pg, "the chart with its table shown", ".bs-chart")
        pg.locator(".bs-chart").screenshot(path=str(screenshot_dir() / "ui_chart_table.png"))
        # Chinese: the same table and words from zh.js
        pg.evaluate("BS.setLang('zh')")
        assert pg.inner_text("[data-testid=table-toggle]") == "隐藏表格"
        head = pg.evaluate("[...document.querySelectorAll('[data-testid=chart-table] thead th')]"
                           ".map(c => c.textContent)")
        assert head[:2] == ["步", "耗时"]
        assert pg.evaluate("(s) => BS.describeStep(s)", steps[-2]) == \
            "第 12 步：Eve 的整个提示词 300 个词元；Alice 等待了 1.20 s"
    finally:
        pg.close()


def test_the_live_region_speaks_at_most_once_a_second(browser):
    pg = browser.new_page(viewport={"width": 1366, "height": 900})
    try:
        stream = lesson2_stream()
        load_stage(pg, stream[:5])
        # a slow machine (a loaded laptop on a projector): each chart draw takes 0-80 ms, more in one frame than
        # the next, which must not bring two announcements closer together than a second
        pg.evaluate("""() => { const clear = CanvasRenderingContext2D.prototype.clearRect;
            CanvasRenderingContext2D.prototype.clearRect = function (...a) {
                const until = performance.now() + 80 * Math.random(); while (performance.now() < until);
                return clear.apply(this, a); }; }""")
        pg.evaluate("""() => { window.said = []; new MutationObserver(() => said.push(performance.now()))
            .observe(document.querySelector('[data-testid=chart-live]'), {childList: true, characterData: true,
                                                                        subtree: true}); }""")
        for r in stream[5:]:                   # a step every 100 ms
            pg.evaluate("(r) => BS.ingestAll([r])", r)
            pg.wait_for_timeout(100)
        pg.wait_for_timeout(1100)
        times = pg.evaluate("said")
        # paced by the time of writing, the frame's last act: the observer hears it within a millisecond or two
        assert len(times) >= 2 and all(b - a >= 990 for a, b in zip(times, times[1:])), times
        assert pg.inner_text("[data-testid=chart-live]").startswith("step 13:")     # the newest, in the end
    finally:
        pg.close()


# ---- phones (1.4.10, 2.5.8) and a language switch that names itself without a CJK font ----

TARGETS = "button, input, textarea, select, a[href], [role=button], [tabindex='0']"


@pytest.mark.parametrize("width", [320, 640], ids=["320px", "200%-zoom-of-1280px"])
def test_join_reflows_and_its_targets_are_at_least_24_px(server, browser, width):
    ctx = browser.new_context(viewport={"width": width, "height": 800}, is_mobile=width == 320, has_touch=True)
    pg = ctx.new_page()
    try:
        pg.goto(server + "/join")
        wait_js(pg, conn_is("live"))
        lang = pg.inner_text("[data-testid=lang]")
        assert lang.startswith("Chinese") and "中文" in lang           # Latin first: no boxes without a CJK font
        pg.fill("[data-testid=student-name]", f"Zed{width}")
        pg.click("[data-testid=join]")
        wait_js(pg, "!document.querySelector('[data-testid=you-are]').hidden")
        pg.wait_for_timeout(500)
        assert pg.evaluate("document.scrollingElement.scrollWidth <= innerWidth"), \
            pg.evaluate("[document.scrollingElement.scrollWidth, innerWidth]")
        small = pg.evaluate(f"""() => [...document.querySelectorAll("{TARGETS}")]
            .filter(e => e.getClientRects().length && getComputedStyle(e).visibility !== 'hidden')
            .map(e => {{ const r = (e.closest('label') || e).getBoundingClientRect();\
   // a label is the input's target too
                        return {{what: e.outerHTML.slice(0, 80), w: r.width, h: r.height}}; }})
            .filter(b => b.w < 24 || b.h < 24)""")
        assert not small, small
    finally:
        ctx.close()


# ---- keyboard (2.1.1, 2.2.2, 2.4.7) and reduced motion (2.3.3) ----

def test_the_chart_is_paused_scrubbed_and_x_rayed_from_the_keyboard(browser):
    ctx = browser.new_context(viewport={"width": 1366, "height": 900}, reduced_motion="reduce")
    pg = ctx.new_page()
    try:
        load_stage(pg, lesson2_stream())
        pg.wait_for_function("BS.view.drawn && BS.view.drawn.steps.length === 14")
        # Tab reaches the chart from the play controls; the focus is drawn
        pg.focus("[data-testid=table-toggle]")
        for _ in range(12):
            pg.keyboard.press("Tab")
            if pg.evaluate("document.activeElement.dataset.testid") == "gantt":
                break
        assert pg.evaluate("document.activeElement.dataset.testid") == "gantt"
        assert pg.evaluate("getComputedStyle(document.activeElement).outlineStyle") == "solid"
        assert "arrows" in pg.get_attribute("[data-testid=gantt]", "aria-label")
        pg.keyboard.press("Space")                                   # 2.2.2: the moving chart stops
        assert pg.evaluate("BS.view.mode") == "paused"
        at = pg.evaluate("BS.view.cursor")
        pg.keyboard.press("ArrowLeft")
        pg.keyboard.press("ArrowLeft")
        assert pg.evaluate("BS.view.cursor") == at - 2
        pg.keyboard.press("Enter")                                   # the column's X-ray, as a click picks it
        assert pg.evaluate("BS.view.picked") == at - 2
        # reduced motion: no transition is left running, and the data still comes
        assert pg.evaluate("getComputedStyle(document.querySelector('.bs-switch-knob')).transitionDuration") == "0s"
        pg.keyboard.press("Space")
        assert pg.evaluate("BS.view.mode") == "live"
        pg.evaluate("(r) => BS.ingestAll([r])", step(14, 3.0, 3.05, [{"req": "r1", "label": "Bob", "kind": "decode",
                                                                       "tokens": 1, "start": 40}]))
        pg.wait_for_function("BS.view.drawn.steps.includes(14)")
    finally:
        ctx.close()


def test_tab_reaches_every_control_of_the_lecturers_page_in_view_and_visibly_focused(server, browser):
    want = {"#bs-lesson-2", "[data-testid=chunked-toggle]", "[data-policy=continuous]", "[data-testid=budget]",
            "[data-testid=pause]", "[data-testid=step]", "[data-testid=replay]", "[data-testid=scrub]",
            "[data-testid=gantt]", "[data-testid=table-toggle]", "#bs-box-0 textarea", "#bs-send-0",
            "#bs-lesson-text-1", "#bs-chat-0 [role=log]"}
    with live_page(browser, server, {"width": 1366, "height": 768}) as pg:
        pg.focus("#bs-lang input")
        reached, hidden, unringed = set(), [], []
        for _ in range(160):
            pg.keyboard.press("Tab")
            got = pg.evaluate("""(want) => { const e = document.activeElement, r = e.getBoundingClientRect();
                const hit = want.find(s => document.querySelector(s) === e);
                // 2.4.11: the focused control is not under anything (the sticky chat column included)
                const x = Math.min(Math.max(r.left + r.width / 2, 0), innerWidth - 1),
                      y = Math.min(Math.max(r.top + Math.min(r.height / 2, 10), 0), innerHeight - 1);
                const top = document.elementFromPoint(x, y);
                const s = getComputedStyle(e);
                return {hit, covered: !!top && top !== e && !e.contains(top) && !top.contains(e),
                        ring: (s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) >= 2) || s.boxShadow !== 'none',
                        inView: r.bottom > 0 && r.top < innerHeight, what: e.outerHTML.slice(0, 70)}; }""",
                              sorted(want))
            if got["hit"]:
                reached.add(got["hit"])
                if got["covered"] or not got["inView"]:
                    hidden.append(got["what"])
                if not got["ring"]:
                    unringed.append(got["what"])
            if reached == want:
                break
        assert reached == want, sorted(want - reached)
        assert not hidden, hidden
        assert not unringed, unringed
