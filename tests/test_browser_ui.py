"""The teaching UI in a real browser: Debian's Chromium driven by Playwright, against one real
server (engine, API, UI) on loopback for the whole module.

Skipped when /usr/bin/chromium is absent (Playwright's own browser download is not used).
Screenshots go to tests/browser.py screenshot_dir() (BATCHSCOPE_SCREENSHOT_DIR, default a temp dir).
"""
import json
import time

import pytest

from tests.browser import MARKS, api, conn_is, live_page, screenshot_dir, served_ui, wait_js

pytestmark = MARKS
SCENARIO = dict(reply_tokens=16, doc_tokens=2, doc_at=8)


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="chunked"), max_tokens=12, doc_max_tokens=2,
                   scenario_params={"long-prompt-interrupts": SCENARIO}) as (url, _):
        yield url


@pytest.fixture
def page(server, browser):
    with live_page(browser, server, {"width": 1400, "height": 1100}) as pg:
        yield pg


@pytest.fixture
def slow_motion(server):
    """A pause after every step, so that streams are seen growing even on a fast machine."""
    api(server, "/api/engine", {"step_delay": 0.05})
    yield
    api(server, "/api/engine", {"step_delay": 0.0})


def replies_done(pg, n_labels):
    """JS: the newest request of each of these labels has ended."""
    labels = json.dumps(n_labels)
    return (f"(() => {{ const want = {labels}; const rs = [...BS.store.reqs.values()];"
            f" return want.every(l => {{ const mine = rs.filter(r => r.label === l);"
            f" return mine.length && mine[mine.length - 1].end != null; }}); }})()")


def settle(pg, i, quiet=1.5, timeout=60):
    """Wait until panel i's chat stops changing: the engine's end reaches the chart through the socket,
    and Gradio's last update of the reply can come after it."""
    deadline, last, since = time.time() + timeout, None, time.time()
    while time.time() < deadline:
        now = pg.locator(f"#bs-chat-{i}").inner_text()
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet:
            return
        time.sleep(0.2)
    raise AssertionError(f"panel {i} kept changing")


def bot_text(pg, i):
    loc = pg.locator(f"#bs-chat-{i} [data-testid=bot]")
    return loc.last.inner_text() if loc.count() else ""


# ---- the tests ----

def test_two_panels_stream_and_share_a_step_in_the_chart(page, server, slow_motion):
    # slow motion from the page's own control: 100 ms after every step
    page.evaluate("""() => { const d = document.querySelector('[data-testid=step-delay]');
                             d.value = 100; d.dispatchEvent(new Event('change')); }""")
    wait_js(page, "document.querySelector('[data-testid=ctl-status]').textContent === 'Applied.'")
    assert api(server, "/api/engine")["step_delay"] == pytest.approx(0.1)
    page.fill("#bs-box-0 textarea", "Tell me about the sea.")
    page.fill("#bs-box-1 textarea", "Tell me about the hills.")
    page.click("#bs-send-0")
    page.click("#bs-send-1")
    seen = {0: set(), 1: set()}
    deadline = time.time() + 120
    while time.time() < deadline:
        for i in seen:
            seen[i].add(bot_text(page, i))
        if page.evaluate(replies_done(page, ["Alice", "Bob"])):
            break
        time.sleep(0.05)
    for i in seen:
        seen[i].add(bot_text(page, i))
        growing = sorted((t for t in seen[i] if t and t != "…"), key=len)
        assert len(growing) >= 2, f"panel {i} did not stream: {growing}"
        assert all(growing[-1].startswith(t) for t in growing), growing
    # both requests are cells of the same step in the chart, in their users' colours
    cell = page.evaluate("""() => {
        const cells = BS.view.drawn.cells, by = new Map();
        // ink drawn over the cells hides their colours there: a settings change's marker line and its flag
        // (the slow-motion switch above is one), and the duration box of a step far slower than the rest
        // (a loaded machine makes some); the chart says where each lies
        const ink = [...BS.view.drawn.slow.filter(s => s.shown).map(s => s.box),
                     ...BS.view.drawn.markers.flatMap(m => m.boxes)];
        const clear = (c) => !ink.some(k => k.x < c.x + c.w && c.x < k.x + k.w && k.y < c.y + c.h && c.y < k.y + k.h);
        for (const c of cells) { if (!by.has(c.step)) by.set(c.step, []); by.get(c.step).push(c); }
        for (const [step, cs] of by) {
          const a = cs.find(c => c.label === 'Alice' && c.kind === 'decode'), \
b = cs.find(c => c.label === 'Bob' && c.kind === 'decode');
          if (a && b && clear(a) && clear(b)) {
            const g = document.querySelector('[data-testid=gantt]').getContext('2d'), d = devicePixelRatio;
            // the colour most of the cell shows (a label drawn over its middle must not decide it)
            const px = (c) => {
              const x0 = Math.round((c.x + 2) * d), y0 = Math.round((c.y + 2) * d);
              const w = Math.max(1, Math.round((c.w - 4) * d)), h = Math.max(1, Math.round((c.h - 4) * d));
              const data = g.getImageData(x0, y0, w, h).data, count = new Map();
              for (let i = 0; i < data.length; i += 4) {
                const k = data[i] + "," + data[i + 1] + "," + data[i + 2];
                count.set(k, (count.get(k) || 0) + 1);
              }
              return [...count.entries()].sort((a, b) => b[1] - a[1])[0][0].split(",").map(Number);
            };
            return {step, alice: px(a), bob: px(b)};
          }
        }
        return null; }""")
    assert cell, "no step shows both requests"
    assert cell["alice"] == [0xE6, 0x9F, 0x00] and cell["bob"] == [0x56, 0xB4, 0xE9], cell
    # the panel headers carry the same name and colour as the chart rows
    assert "Alice" in page.inner_text("[data-testid=panel-head-0]")


def test_chunked_prefill_switch_flips_the_policy_and_marks_the_chart(page, server):
    api(server, "/api/engine", {"policy": "chunked"})
    page.click("#bs-short-2")                                          # some steps under chunked first
    wait_js(page, replies_done(page, ["Carol"]))
    toggle = page.locator("[data-testid=chunked-toggle]")
    wait_js(page, "document.querySelector('[data-testid=chunked-toggle]').getAttribute('aria-checked') === 'true'")
    for policy, state in (("continuous", "false"), ("chunked", "true")):
        toggle.click()
        wait_js(page, "document.querySelector('[data-testid=chunked-toggle]')"
                      f".getAttribute('aria-checked') === '{state}'")
        assert api(server, "/api/engine")["policy"] == policy
        page.click("#bs-short-2")
        wait_js(page, f"BS.view.drawn.markers.some(m => m.policy === '{policy}')")
        wait_js(page, replies_done(page, ["Carol"]))
    texts = page.evaluate("BS.view.drawn.markers.map(m => m.text)")
    assert any("OFF" in t and "continuous" in t for t in texts) and "chunked prefill ON" in texts
    on = page.evaluate("BS.view.drawn.markers.filter(m => m.policy === 'chunked').pop()")
    line = page.evaluate(f"Array.from(document.querySelector('[data-testid=gantt]').getContext('2d')"
                         f".getImageData({on['x']} * devicePixelRatio, 120 * devicePixelRatio, 1, 1).data.slice(0, 3))")
    assert max(line) < 40, f"no dark marker line at x={on['x']}: {line}"
    assert page.inner_text("[data-testid=chunked-state]") == "ON"
    assert page.locator("[data-testid=policy] button[aria-checked=true]").inner_text().endswith("chunked")


def test_pause_single_step_replay_and_resume(page, slow_motion):
    page.click("#bs-short-3")
    wait_js(page, "[...BS.store.reqs.values()].some(r => r.label === 'Dan' && r.end == null && r.tokens.length >= 2)")
    page.click("[data-testid=pause]")
    assert page.get_attribute("[data-testid=play-state]", "data-mode") == "paused"
    held = page.evaluate("BS.view.drawn.steps.at(-1)")
    wait_js(page, f"BS.store.steps.at(-1).step >= {held} + 2")         # the engine goes on...
    time.sleep(0.3)
    assert page.evaluate("BS.view.drawn.steps.at(-1)") == held          # ...the chart holds still
    page.click("[data-testid=step]")
    nxt = page.evaluate(f"BS.store.steps.find(s => s.step > {held}).step")
    wait_js(page, f"BS.view.drawn.steps.at(-1) === {nxt}")
    page.click("[data-testid=step-back]")
    wait_js(page, f"BS.view.drawn.steps.at(-1) === {held}")
    page.click("[data-testid=replay]")
    assert page.get_attribute("[data-testid=play-state]", "data-mode") == "replay"
    page.click("[data-testid=resume]")
    wait_js(page, "BS.view.drawn.steps.at(-1) === BS.store.steps.at(-1).step")
    assert page.get_attribute("[data-testid=play-state]", "data-mode") == "live"
    wait_js(page, replies_done(page, ["Dan"]))
    # the language switch turns the chart's words and the Gradio parts to Chinese, and back
    page.click("#bs-lang label:has-text('中文')")
    wait_js(page, "document.querySelector('[data-i18n=\"chart.title\"]').textContent.includes('前向计算')")
    page.wait_for_function("document.querySelector('#bs-lesson-1').textContent.includes('静态')")
    assert "分块预填充" in page.inner_text("[data-testid=controls]")
    page.click("#bs-lang label:has-text('English')")
    page.wait_for_function("document.querySelector('#bs-lesson-1').textContent.includes('static')")


def test_bad_input_gets_a_friendly_error_and_the_other_panels_carry_on(page, server):
    page.click("#bs-send-0")                                           # empty
    page.fill("#bs-box-1 textarea", "y" * 20_001)                      # oversize
    page.click("#bs-send-1")
    page.wait_for_selector("#bs-notice-0 [role=alert]")
    page.wait_for_selector("#bs-notice-1 [role=alert]")
    assert "empty" in page.inner_text("#bs-notice-0")
    assert "too long" in page.inner_text("#bs-notice-1") and "20,001" in page.inner_text("#bs-notice-1")
    # typed HTML shows as text; a hostile API label shows as text in the chart's tooltip
    evil = "<img src=x onerror=\"window.__pwned=1\"><b>bold</b>"
    page.fill("#bs-box-2 textarea", evil)
    page.click("#bs-send-2")
    api(server, "/v1/chat/completions", {"max_tokens": 4, "user": "<img src=y onerror=alert(1)>",
                                         "messages": [{"role": "user", "content": "hi"}]})
    wait_js(page, replies_done(page, ["Carol"]))
    assert evil in page.inner_text("#bs-chat-2 [data-testid=user]")
    assert page.locator("#bs-chat-2 img, #bs-chat-2 b").count() == 0
    assert page.evaluate("window.__pwned") is None
    page.click("[data-testid=pause]")
    cell = page.evaluate("BS.view.drawn.cells.find(c => c.label.startsWith('<img'))")
    assert cell, "the API request is not in the chart"
    box = page.locator("[data-testid=gantt]").bounding_box()
    page.mouse.move(box["x"] + cell["x"] + cell["w"] / 2, box["y"] + cell["y"] + cell["h"] / 2)
    tip = page.locator("[data-testid=tooltip]")
    tip.wait_for(state="visible")
    assert "<img src=y" in tip.inner_text() and tip.locator("img").count() == 0
    page.click("[data-testid=resume]")
    # the notices clear on a good message, and the panels with errors work again
    page.fill("#bs-box-0 textarea", "Hello again.")
    page.click("#bs-send-0")
    wait_js(page, "!document.querySelector('#bs-notice-0 [role=alert]')")
    wait_js(page, replies_done(page, ["Alice"]))
    assert bot_text(page, 0)
    settle(page, 0)
    # the chat's own clear button empties the panel for good: the next reply comes alone
    page.click("#bs-chat-0 button[aria-label=Clear]")
    wait_js(page, "document.querySelectorAll('#bs-chat-0 [data-testid=user]').length === 0")
    page.fill("#bs-box-0 textarea", "One more.")
    page.click("#bs-send-0")
    wait_js(page, replies_done(page, ["Alice"]))
    time.sleep(0.5)
    assert page.locator("#bs-chat-0 [data-testid=user]").all_inner_texts() == ["One more."]


def test_a_dropped_socket_reconnects_and_backfills(page, server):
    page.evaluate("window.__connect = BS.connect; BS.connect = () => {}; BS.dropSocket()")
    wait_js(page, conn_is("lost"))
    before = page.evaluate("BS.store.steps.length ? BS.store.steps.at(-1).step : -1")
    reply = api(server, "/v1/chat/completions", {"max_tokens": 6, "user": "Offline",
                                                 "messages": [{"role": "user", "content": "Count to three."}]})
    n = reply["usage"]["completion_tokens"]
    last = api(server, "/api/engine")["step"] - 1
    assert last > before
    page.evaluate("BS.connect = window.__connect; BS.connect()")
    wait_js(page, conn_is("live"))
    wait_js(page, f"BS.store.steps.length && BS.store.steps.at(-1).step >= {last}")   # the snapshot may follow "live"
    have = set(page.evaluate(f"BS.store.steps.filter(s => s.step > {before}).map(s => s.step)"))
    assert set(range(before + 1, last + 1)) <= have, "steps missed while offline were not backfilled"
    # a backfilled step lands out of order: the request's tokens are recounted on the next frame
    wait_js(page, f"[...BS.store.reqs.values()].some(r => r.label === 'Offline' && r.tokens.length === {n})",
            timeout=10)


PICTURE = {"continuous": "ui_chunked_off.png", "chunked": "ui_chunked_on.png"}
STAGE_TO_METRICS = """() => { const s = document.querySelector('[data-testid=stage]').getBoundingClientRect(),
    m = document.querySelector('[data-testid=metrics]').getBoundingClientRect();
    return {x: s.left + scrollX, y: s.top + scrollY, width: s.width, height: m.bottom - s.top}; }"""


def test_long_prompt_stalls_everyone_until_chunked_prefill_is_on(page, tmp_path, slow_motion):
    shots = screenshot_dir()
    shots.mkdir(parents=True, exist_ok=True)
    runs = {}
    for lesson, policy in ((2, "continuous"), (3, "chunked")):
        start = page.evaluate("BS.store.steps.length ? BS.store.steps.at(-1).step + 1 : 0")
        page.click(f"#bs-lesson-{lesson}")
        mine = f"[...BS.store.reqs.values()].filter(r => r.arrived != null && r.firstStep >= {start})"
        try:
            wait_js(page, f"{mine}.length === 4 && {mine}.every(r => r.end != null)", timeout=240)
        except Exception as e:
            state = page.evaluate(f"{mine}.map(r => [r.label, r.rid, r.promptLen, r.tokens.length, r.end])")
            pytest.fail(f"lesson {lesson} did not finish ({str(e)[:200]}): {state}; last step "
                        f"{page.evaluate('BS.store.steps.at(-1).step')}; note {page.inner_text('#bs-note')!r}")
        page.click("[data-testid=pause]")
        time.sleep(0.3)
        runs[policy] = page.evaluate(f"""() => {{
            const steps = BS.store.steps.filter(s => s.step >= {start});
            const doc = steps.filter(s => s.items.some(i => i.label === 'Dan' && i.kind === 'prefill'));
            return {{policy: steps.map(s => s.policy), docSteps: doc.length, docTokens: doc.map(s => s.num_tokens),
                     stalledInDoc: doc.map(s => (s.stalled || []).length),
                     decodesInDoc: doc.map(s => s.items.filter(i => i.kind === 'decode').length),
                     drawnStalls: BS.view.drawn.cells.filter(c => c.kind === 'stall' && c.step >= {start}).length}}; \
}}""")
        # docs/ui_chunked_off.png and ui_chunked_on.png (README's first picture): the stage down to the metrics
        page.screenshot(path=str(shots / PICTURE[policy]), full_page=True, clip=page.evaluate(STAGE_TO_METRICS))
        page.click("[data-testid=resume]")
    off, on = runs["continuous"], runs["chunked"]
    assert set(off["policy"]) == {"continuous"} and set(on["policy"]) == {"chunked"}
    # off: the whole document in one step over budget, and the three chats stall in it (drawn as such)
    assert off["docSteps"] == 1 and off["docTokens"][0] > 1000 and off["stalledInDoc"] == [3]
    assert off["drawnStalls"] >= 3
    # on: the document in budget-sized chunks, each carrying everyone's decode token; nobody stalls
    assert on["docSteps"] >= 5 and max(on["docTokens"]) <= 256
    assert set(on["stalledInDoc"]) == {0} and min(on["decodesInDoc"]) >= 1 and max(on["decodesInDoc"]) == 3
    assert on["drawnStalls"] == 0
    for policy in runs:
        assert (shots / PICTURE[policy]).stat().st_size > 10_000
