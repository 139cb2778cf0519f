"""Lessons 6 (prefix caching) and 7 (memory pressure) in a real browser on the default model, at a
projector's 1366x768: pressed as a lecturer presses them, paused mid-run, looked at.

Lesson 6: the chart draws later prefill cells with a cached part, the KV map shows blocks held by several
requests, the metrics table's hit-rate row is filled. Lesson 7: a preemption frees blocks and the
preempted request is read again as a prefill of its prompt and reply so far. Screenshots go to
tests/browser.py screenshot_dir() (BATCHSCOPE_SCREENSHOT_DIR=docs refreshes docs/ui_lesson6_prefix.png
and docs/ui_lesson7_memory.png).
"""
import time

import pytest

from app.replay.scenarios import LESSONS
from tests.browser import MARKS, live_page, screenshot_dir, served_ui, wait_js

pytestmark = MARKS
SIX = next(k for k, x in enumerate(LESSONS, 1) if x.scenario == "shared-system-prompt")
SEVEN = next(k for k, x in enumerate(LESSONS, 1) if x.scenario == "memory-pressure")


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="chunked"), {"step_delay": 0.03}) as (url, _):
        yield url


@pytest.fixture
def page(server, browser):
    with live_page(browser, server, {"width": 1366, "height": 768}) as pg:
        yield pg


def close_up(pg, steps: int):
    """For the picture: few steps in view (wide cells), the chart at the top of the screen."""
    pg.evaluate(f"(() => {{ const z = document.querySelector('[data-testid=zoom]'); z.value = {steps};"
                " z.dispatchEvent(new Event('input')); })()")
    pg.evaluate("document.querySelector('[data-testid=gantt]').scrollIntoView({block: 'start'})")
    time.sleep(0.8)


def test_lesson_six_draws_cached_prefill_and_shared_blocks(page):
    start = page.evaluate("BS.store.steps.length ? BS.store.steps.at(-1).step + 1 : 0")
    page.click(f"#bs-lesson-{SIX}")
    # mid-run of the caching pass: three customers have their first token, the later ones hit
    wait_js(page, f"BS.store.steps.filter(s => s.step >= {start}).flatMap(s => s.items)"
                  ".filter(i => i.cached > 0).length >= 2", timeout=240)
    page.click("[data-testid=pause]")
    time.sleep(1.0)
    cells = page.evaluate(f"BS.view.drawn.cells.filter(c => c.step >= {start} && c.kind === 'prefill')")
    assert any(c["cached"] > 300 for c in cells), cells          # the ~370-token system prompt, cached
    shared = page.evaluate("BS.kvMapShown().blocks.filter(b => b[1].length > 1).length")
    assert shared >= 20, shared                                   # its 16-token blocks, held by several
    hit = page.evaluate("document.querySelector('[data-testid=metrics] tr[data-metric=hit] td:last-child').textContent")
    assert hit.endswith("%") and float(hit.split()[0]) > 0, hit
    close_up(page, 40)
    page.screenshot(path=str(screenshot_dir() / "ui_lesson6_prefix.png"))
    page.click("[data-testid=resume]")
    wait_js(page, "BS.store.steps.at(-1).prefix_caching === false", timeout=240)   # the second pass began
    mine = f"[...BS.store.reqs.values()].filter(r => r.arrived != null && r.firstStep >= {start})"
    wait_js(page, f"{mine}.length === 12 && {mine}.every(r => r.end != null)", timeout=300)


def test_lesson_seven_preempts_frees_and_recomputes(page):
    start = page.evaluate("BS.store.steps.length ? BS.store.steps.at(-1).step + 1 : 0")
    page.click(f"#bs-lesson-{SEVEN}")
    # a preempted request comes back: a prefill item whose prompt_len holds its reply so far
    js = (f"BS.store.steps.filter(s => s.step >= {start}).some(s => s.items.some(i => i.kind === 'prefill' && "
          f"BS.store.steps.some(p => p.step >= {start} && p.step < s.step && p.preempted.includes(i.req))))")
    wait_js(page, js, timeout=300)
    page.click("[data-testid=pause]")
    time.sleep(1.0)
    steps = page.evaluate(f"BS.store.steps.filter(s => s.step >= {start})")
    victims = {r for s in steps for r in s["preempted"]}
    assert victims and all(s["kv"]["used"] <= s["kv"]["limit"] for s in steps if s["kv"].get("limit"))
    frees = [op for s in steps for op in s.get("kv_ops", []) if op["op"] == "free" and op["req"] in victims]
    assert frees, "a preemption freed no block"
    close_up(page, 120)
    page.screenshot(path=str(screenshot_dir() / "ui_lesson7_memory.png"))
    page.click("[data-testid=resume]")
