"""The fourth setting in a real browser (Debian's Chromium driven by Playwright).

Under `disaggregated` the chart must show one lane per worker, prefill steps on one and decode
steps on the other running at the same time, each request's KV hand-over drawn between them, and
the metrics a transfer line for that setting. Two ways in:
- offline: the real DisaggregatedEngine runs the lesson's scenario in-process and its stream is
  fed to the stage as a trace file would be (BS.ingestAll);
- live: one real server on loopback; lesson 5 runs the long document chunked, then switches the
  service to the prefill and decode workers and runs it disaggregated. Writes docs/ui_disaggregated.png.
"""
from pathlib import Path

import pytest

from tests.browser import MARKS, api, live_page, load_stage, screenshot_dir, served_ui, wait_js

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = dict(reply_tokens=40, doc_tokens=4, doc_at=6)
pytestmark = MARKS


@pytest.fixture(scope="module")
def server():
    from engine import EngineConfig
    with served_ui(EngineConfig(kv_cache_gb=0.25, policy="chunked"), max_tokens=12,
                   scenario_params={"split-prefill-decode": SCENARIO}) as (url, service):
        yield url
    service.stop()


@pytest.fixture
def page(server, browser):  # noqa: F811
    with live_page(browser, server, {"width": 1500, "height": 1200}) as pg:
        yield pg


def drawn_lanes(pg) -> dict:
    """What the chart drew: axis, lane headers, cells with their lane and times, hand-over marks, lane titles."""
    return pg.evaluate("""() => { const d = BS.view.drawn;
        return {axis: d.win.axis, heads: d.rows.filter(r => r.header).map(r => r.lane),
                cells: d.cells.map(c => ({lane: c.lane, kind: c.kind, label: c.label, t0: c.t0, t1: c.t1})),
                handovers: d.handovers,
                titles: [...document.querySelectorAll('[data-testid=row-labels] li[data-header]')]\
.map(l => l.textContent)}; }""")


def check_lanes(drawn: dict, threads: dict[str, int], label: str, blocks: int):
    """Two lanes headed by their worker and its real thread count; prefill cells on one, decode cells on the
    other, some at the same time; the hand-over of `label` drawn downwards with its size."""
    # across the switch the single engine's steps keep a lane of their own, on top
    assert drawn["axis"] == "time" and drawn["heads"] in (["prefill", "decode"], ["engine", "prefill", "decode"])
    for lane, title in zip(drawn["heads"], drawn["titles"]):
        n = threads.get(lane)
        assert title == ("one engine (before the switch)" if lane == "engine" else
                         f"{lane} worker · {n} thread" + ("s" if n != 1 else ""))
    pre = [c for c in drawn["cells"] if c["lane"] == "prefill"]
    dec = [c for c in drawn["cells"] if c["lane"] == "decode"]
    assert pre and dec and {c["kind"] for c in pre} == {"prefill"} and {c["kind"] for c in dec} == {"decode"}
    assert any(p["t0"] < d["t1"] and d["t0"] < p["t1"] for p in pre for d in dec), "no two lanes' cells overlap"
    mark = next(h for h in drawn["handovers"] if h["label"] == label)
    assert mark["blocks"] == blocks and mark["y1"] > mark["y0"] and f"{blocks} blocks" in mark["text"]


@pytest.fixture(scope="module")
def recorded():
    """The lesson's scenario on the real DisaggregatedEngine (two worker processes), as a stream."""
    from app.replay.scenarios import get_scenario
    from demos.compare.runner import run_scenario
    from engine import EngineConfig
    from engine.disagg.router import DisaggregatedEngine
    with DisaggregatedEngine(EngineConfig(policy="disaggregated", kv_cache_gb=0.25, max_num_batched_tokens=128)) as e:
        return run_scenario(e, get_scenario("split-prefill-decode", **SCENARIO)).stream


def offline_page(browser, stream):  # noqa: F811
    """The stage alone, fed `stream` as a trace file would be. Returns the page and its list of errors."""
    pg = browser.new_page(viewport={"width": 1500, "height": 1200})
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    load_stage(pg, stream)
    return pg, errors


def test_a_recorded_disaggregated_run_draws_two_lanes_and_the_hand_overs(recorded, browser):  # noqa: F811
    from app.readers import metrics
    steps = metrics.steps(recorded)
    moved = [e for e in recorded if e.get("event") == "kv_transfer"]
    threads = {s["worker"]: s["threads"] for s in steps}
    assert set(threads) == {"prefill", "decode"} and len(moved) == 4
    pg, errors = offline_page(browser, recorded)
    doc = next(e for e in moved if e["label"] == "Doc")
    after = next(s["step"] for s in steps if s["worker"] == "decode" and s["t_end"] >= doc["t"])
    at = min(after + 6, steps[-1]["step"])         # a few decode steps after the hand-over, in view with it
    pg.evaluate("(n) => BS.play.seek(n)", at)
    pg.wait_for_function("(n) => BS.view.drawn && BS.view.drawn.steps.includes(n)", arg=at)
    check_lanes(drawn_lanes(pg), threads, "Doc", doc["blocks"])
    # the metrics table follows the chart on its own cadence: wait for its hand-over line
    pg.wait_for_function("document.querySelector('[data-testid=metrics] tr[data-metric=transfer] td')")
    row = pg.evaluate("[...document.querySelectorAll('[data-testid=metrics] tr[data-metric=transfer] td')]"
                      ".map(td => JSON.parse(td.dataset.values))")
    assert row == [[4, metrics.stretches(recorded)[0]["transfer_p50_s"],
                    metrics.stretches(recorded)[0]["transfer_p99_s"], sum(e["bytes"] for e in moved)]]
    pg.locator("[data-testid=stage] .bs-chart").screenshot(path=str(screenshot_dir() / "ui_disaggregated.png"))
    assert not errors, errors
    pg.close()


def test_each_workers_kv_map_lets_go_of_a_handed_over_prompt(recorded, browser):  # noqa: F811
    """Once a prompt's KV has moved, the prefill worker holds none of its blocks (they stay cached there,
    for a prefix hit). No prefill step reports the frees of the last hand-over, so the hand-over event
    carries them; each lane's map, in Python (app/readers/analysis.kv_blocks) and on the page, is rebuilt from
    its worker's steps and the hand-overs it sent."""
    from app.readers import analysis, metrics
    last = metrics.steps(recorded)[-1]["step"]
    want = {lane: analysis.kv_blocks(recorded, worker=lane) for lane in ("prefill", "decode")}
    for lane, blocks in want.items():                  # every request ended: nothing is held
        assert not any(holders for holders, _ in blocks.values()), (lane, blocks)
    assert any(cached for _, cached in want["prefill"].values())      # the prompts stay cached there
    doc = next(e for e in recorded if e.get("event") == "kv_transfer" and e["label"] == "Doc")
    before = analysis.kv_blocks([o for o in recorded if o is not doc], worker="prefill")
    assert any(doc["req"] in holders for holders, _ in before.values())   # without the hand-over's frees
    pg, errors = offline_page(browser, recorded)
    pg.evaluate("(n) => BS.play.seek(n)", last)
    pg.wait_for_function("(n) => BS.kvMapShown() && BS.kvMapShown().step == n", arg=last)
    shown = pg.evaluate("() => BS.kvMapShown().lanes")
    assert {lane: {b: (tuple(h), c) for b, h, c in blocks} for lane, blocks in shown.items()} == want
    assert not errors, errors
    pg.close()


def test_lesson_five_draws_two_workers_side_by_side_and_the_kv_hand_over(page, server):
    start = page.evaluate("BS.store.steps.length ? BS.store.steps.at(-1).step + 1 : 0")
    page.click("#bs-lesson-5")
    # the chunked pass, then the switch: the page says it is waiting for the two workers to load
    wait_js(page, "document.querySelector('#bs-note').textContent"
                  ".includes('waiting for the prefill and decode workers')",
            timeout=300)
    # both passes: the four scripted requests under chunked, then four more under disaggregated, all ended
    runs = f"[...BS.store.reqs.values()].filter(r => r.arrived != null && r.firstStep >= {start})"
    try:
        wait_js(page, f"{runs}.length === 8 && {runs}.every(r => r.end != null)", timeout=420)
    except Exception as e:
        state = page.evaluate(f"{runs}.map(r => [r.label, r.rid, r.tokens.length, r.end, r.reason])")
        pytest.fail(f"lesson 5 did not finish ({str(e)[:200]}): {state}; note {page.inner_text('#bs-note')!r}")
    assert page.locator("[data-testid=policy] button[aria-checked=true]").get_attribute("data-policy") == \
        "disaggregated"
    assert page.locator("[data-testid=disagg-note]").is_visible()

    # the records: prefill steps on one worker, decode steps on the other, at the same time
    got = page.evaluate(f"""() => {{
        const steps = BS.store.steps.filter(s => s.step >= {start} && s.worker);
        const pre = steps.filter(s => s.worker === 'prefill'), dec = steps.filter(s => s.worker === 'decode');
        const overlap = pre.filter(p => dec.some(d => d.t_start < p.t_end && p.t_start < d.t_end)).map(s => s.step);
        return {{policies: [...new Set(steps.map(s => s.policy))],
                 preKinds: [...new Set(pre.flatMap(s => s.items.map(i => i.kind)))],
                 decKinds: [...new Set(dec.flatMap(s => s.items.map(i => i.kind)))],
                 overlap, docPrefill: pre.filter(s => s.items.some(i => i.label === 'Dan')).map(s => s.step),
                 transfers: BS.store.transfers.filter(x => x.t >= steps[0].t_start)}}; }}""")
    assert got["policies"] == ["disaggregated"]
    assert got["preKinds"] == ["prefill"] and got["decKinds"] == ["decode"]
    assert set(got["docPrefill"]) & set(got["overlap"]), "the document's prefill never ran beside a decode step"
    assert len(got["transfers"]) == 4 and all(x["blocks"] > 0 and x["bytes"] > 0 and x["seconds"] >= 0
                                              for x in got["transfers"])

    # the chart, paused where the document's KV is handed over: two lanes, cells in both at once, the arrow
    doc = next(x for x in got["transfers"] if x["label"] == "Dan")
    page.click("[data-testid=pause]")
    page.evaluate("(t) => BS.play.seek(BS.store.steps.find(s => s.t_end >= t && s.worker === 'decode').step + 6)",
                  doc["t"])
    page.wait_for_timeout(600)
    threads = page.evaluate("Object.fromEntries(BS.store.steps.filter(s => s.worker).map(s => [s.worker, s.threads]))")
    check_lanes(drawn_lanes(page), threads, "Dan", doc["blocks"])

    # the metrics: a column for each setting, and the transfer line filled for disaggregated only
    cols = page.evaluate("""() => { const t = document.querySelector('[data-testid=metrics] table');
        const heads = [...t.tHead.rows[0].querySelectorAll('th[data-policy]')].map(th => th.dataset.policy);
        const row = t.querySelector('tr[data-metric=transfer]');
        return {heads, transfer: row ? [...row.cells].slice(1).map(td => JSON.parse(td.dataset.values)) : null}; }""")
    assert cols["heads"][-2:] == ["chunked", "disaggregated"] and cols["transfer"] is not None
    assert cols["transfer"][-1][0] >= 1 and cols["transfer"][-2][0] == 0

    page.locator("[data-testid=stage]").screenshot(path=str(screenshot_dir() / "ui_disaggregated_lesson.png"))
    page.click("[data-testid=resume]")
    # back to one engine: the next steps carry no worker
    page.click("[data-testid=policy] button[data-policy=chunked]")
    wait_js(page, "document.querySelector('[data-testid=policy] button[aria-checked=true]')"
                  ".dataset.policy === 'chunked'")
    assert api(server, "/api/engine")["policy"] == "chunked"


def test_the_hand_overs_labels_never_cover_one_another(browser):  # noqa: F811
    """A saved real run (tests/data/disagg_trace.json) on a wall-time axis, the whole of it in view: eight
    hand-overs, four of them within two seconds. Every label drawn is a box of its own."""
    from demos.compare import trace
    stream = trace.load(Path(__file__).parent / "data" / "disagg_trace.json")
    pg, errors = offline_page(browser, stream)
    pg.wait_for_function("BS.view.drawn && BS.view.drawn.handovers && BS.view.drawn.handovers.length >= 8")
    marks = pg.evaluate("BS.view.drawn.handovers")
    boxes = [m["box"] for m in marks if m["box"]]
    assert len(boxes) >= 6, marks
    for i, (x, y, w, h) in enumerate(boxes):
        for (x2, y2, w2, h2) in boxes[i + 1:]:
            assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, ((x, y, w, h), (x2, y2, w2, h2))
    assert not errors, errors
    pg.close()
