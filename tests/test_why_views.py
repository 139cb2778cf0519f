"""The "why" views in a real browser: static/analysis.js against app/readers/analysis.py, and what the views draw.

A recorded trace (tests/data/why_trace.json, `python -m tests.record_why_trace`: every
stall cause and a preemption, on the default model) and synthetic streams are fed to
the stage offline, as a trace file would be. The page's fit, advice, gap causes and
cause table must equal Python's; the X-ray of a picked step must list exactly that
record's items; each view draws live and while the chart is paused for replay.
"""
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.readers import analysis, metrics
from demos.compare import trace
from tests.browser import MARKS, chromium, load_stage, screenshot_dir
from tests.factories import linear_stream

ROOT = Path(__file__).resolve().parent.parent
TRACE = Path(__file__).parent / "data" / "why_trace.json"
GPU_TRACE = ROOT / "static" / "data" / "gpu_cost_trace.json"
pytestmark = MARKS


@pytest.fixture(scope="module")
def page():
    with chromium() as browser:
        pg = browser.new_page(viewport={"width": 1400, "height": 1800})
        errors = []
        pg.on("pageerror", lambda e: errors.append(str(e)))

        def load(stream: list[dict]):
            load_stage(pg, stream, "window.BS && BS.store && BS.analysis")
            pg.wait_for_function("document.querySelector('[data-testid=cost-model]').dataset.a !== undefined")
            assert not errors, errors
            return pg

        yield load


def close(a, b, rel=1e-9):
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=rel,
                                                                                          abs_tol=1e-12))


def page_fit(pg):
    return pg.evaluate("""() => {
        const st = BS.store.steps, d = BS.analysis.devices(st)[0];
        return BS.analysis.fitCost(BS.analysis.costPoints(st, d), d); }""")


def check_fit(got, want):
    assert got["device"] == want.device and got["n"] == want.n and got["terms"] == want.terms
    for k in ("a", "b", "c", "r2"):
        assert close(got[k], getattr(want, k), rel=1e-7), (k, got[k], getattr(want, k))


def test_recorded_trace_fit_causes_and_table_match_python(page):
    objs = trace.load(TRACE)
    pg = page(objs)
    check_fit(page_fit(pg), analysis.fit_stream(objs)[0])
    got = pg.evaluate("() => BS.analysis.gapCauses(BS.store.steps)"
                      ".map((g) => ({...g, cause: BS.analysis.gapCause(g)}))")
    want = analysis.gap_causes(objs)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert (g["req"], g["after"], g["step"], g["cause"]) == (w.req, w.after, w.step, w.cause)
        assert close(g["seconds"], w.seconds)
        assert [(p["step"], p["cause"], p["by"], p["byTokens"]) for p in g["parts"]] == \
               [(p.step, p.cause, p.by, p.by_tokens) for p in w.parts]
    # the cause table: newest four stretches, one cell per cause, Python's seconds
    cells = pg.evaluate("""() => [...document.querySelectorAll('[data-testid=stall-causes] tr[data-cause]')].map(
        (tr) => [tr.dataset.cause, [...tr.querySelectorAll('td')].map((td) => +td.dataset.value)])""")
    want_cols = analysis.cause_time(objs)[-4:]
    assert [c for c, _ in cells] == list(analysis.CAUSES)
    for cause, values in cells:
        assert len(values) == len(want_cols)
        assert all(close(v, col[cause]) for v, col in zip(values, want_cols)), cause
    # the advisor: Python's budget for the page's target and context
    box = pg.evaluate("() => ({...document.querySelector('[data-testid=cost-model]').dataset})")
    fit = analysis.fit_stream(objs)[0]
    ctx = analysis.median([p.context for p in analysis.cost_points(objs, fit.device)])
    assert close(float(box["context"]), ctx) and box["regime"] == analysis.regime(fit, int(box["budget"]))
    advice = pg.evaluate("() => document.querySelector('[data-role=advice]').dataset.budget")
    target = float(pg.input_value("[data-testid=tbt-target]")) / 1000   # a default this machine can meet
    assert target > 0
    want_advice = analysis.advise_budget(fit, target, ctx)
    assert want_advice is not None
    assert advice == ("" if want_advice is None else str(want_advice))


def test_gpu_trace_beside_the_live_fit_with_its_own_fit_and_caption(page):
    objs = trace.load(TRACE)
    pg = page(objs)
    part = "[data-testid=cost-model] [data-role=gpu]"
    assert pg.locator(part).is_hidden()
    pg.evaluate("(g) => BS.loadGpuTrace(g)", trace.load(GPU_TRACE))
    pg.check("[data-testid=gpu-compare]")
    pg.wait_for_function("(sel) => document.querySelector(sel).dataset.a !== undefined", arg=part)
    got = pg.evaluate("(sel) => ({...document.querySelector(sel).dataset})", part)
    gpu_objs = trace.load(GPU_TRACE)
    want = analysis.fit_stream(gpu_objs)[0]
    assert got["device"] == want.device == "cuda/bfloat16" and int(got["n"]) == want.n
    for k in ("a", "b", "c", "r2"):
        assert close(float(got[k]), getattr(want, k), rel=1e-7), k
    assert got["regime"] == analysis.regime(want, int(got["budget"])) == "flat"
    text = pg.locator(part).text_content()
    assert "random weights" in text and "H200" in text and "almost free" in text
    # the live CPU fit is still there, proportional, on its own plot
    cpu = pg.evaluate("() => ({...document.querySelector('[data-testid=cost-model]').dataset})")
    assert cpu["device"] == "cpu/float32" and cpu["regime"] == "proportional"
    pg.wait_for_timeout(500)
    pg.locator("[data-testid=cost-model]").screenshot(path=str(screenshot_dir() / "ui_cost_model_gpu.png"))
    pg.uncheck("[data-testid=gpu-compare]")
    pg.wait_for_function("(sel) => document.querySelector(sel).hidden", arg=part)


@settings(max_examples=15)
@given(a=st.floats(0.001, 0.1), b=st.floats(1e-5, 1e-2), c=st.floats(0, 1e-4),
       shapes=st.lists(st.tuples(st.lists(st.integers(0, 500), max_size=6),
                                 st.one_of(st.none(), st.tuples(st.integers(0, 300), st.integers(1, 64)))),
                       min_size=3, max_size=30).filter(lambda s: all(d or c for d, c in s)),
       noise=st.lists(st.floats(0.0, 0.01), min_size=30, max_size=30))
def test_random_streams_page_fit_matches_python(page, a, b, c, shapes, noise):
    stream = linear_stream(a, b, c, shapes)
    stream = [dict(r, t_end=r["t_end"] + e) for r, e in zip(stream, noise)]
    check_fit(page_fit(page(stream)), analysis.fit_stream(stream)[0])


def xray_rows(pg):
    return pg.evaluate("""() => [...document.querySelectorAll('[data-testid=step-xray] tbody tr')].map((tr) => ({
        req: tr.dataset.req, kind: tr.dataset.kind, start: +tr.dataset.start, end: +tr.dataset.end,
        context: +tr.dataset.context, blocks: +tr.dataset.blocks}))""")


def test_xray_of_a_picked_step_lists_exactly_its_items_live_and_paused(page):
    objs = trace.load(TRACE)
    pg = page(objs)
    recs = metrics.steps(objs)
    mixed = next(r for r in recs if {i["kind"] for i in r["items"]} == {"decode", "prefill"})
    for rec in (recs[-1], mixed):
        if rec is mixed:      # a column picked on the chart: the gantt's click hook opens it
            pg.evaluate("(n) => BS.play.seek(n)", rec["step"])
            pg.evaluate("(n) => BS.onStepClick(BS.store.steps.find((s) => s.step === n))", rec["step"])
        pg.wait_for_function("(n) => document.querySelector('[data-testid=step-xray]').dataset.step == n",
                             arg=rec["step"])
        bs = rec["kv"]["block_size"]
        want = [{"req": i["req"], "kind": i["kind"], "start": i["start"], "end": i["start"] + i["tokens"] - 1,
                 "context": i["start"] + i["tokens"], "blocks": -(-(i["start"] + i["tokens"]) // bs)}
                for i in rec["items"]]
        assert xray_rows(pg) == want
    # paused at an earlier step, the cost view fits only the steps up to it
    n = pg.evaluate("() => +document.querySelector('[data-testid=cost-model]').dataset.n")
    assert n == len(analysis.cost_points([r for r in objs if r.get("type") != "step" or r["step"] <= mixed["step"]]))


def test_the_xray_and_the_chart_name_a_verifying_decodes_kept_and_rejected_drafts(page):
    objs = trace.load(Path(__file__).parent / "data" / "spec_trace.json")
    pg = page(objs)
    rec = next(r for r in metrics.steps(objs)
               if any(0 < i.get("accepted", 0) < i.get("drafted", 0) for i in r["items"]))
    pg.evaluate("(n) => BS.play.seek(n)", rec["step"])
    pg.evaluate("(n) => BS.onStepClick(BS.store.steps.find((s) => s.step === n))", rec["step"])
    pg.wait_for_function("(n) => document.querySelector('[data-testid=step-xray]').dataset.step == n", arg=rec["step"])
    rows = pg.evaluate("""() => [...document.querySelectorAll('[data-testid=step-xray] tr[data-req]')].map((r) =>
        ({req: r.dataset.req, drafted: r.dataset.drafted, accepted: r.dataset.accepted, \
text: r.cells[1].textContent}))""")
    for it, row in zip(rec["items"], rows):
        if it.get("drafted"):
            kept, rejected = it["accepted"], it["drafted"] - it["accepted"]
            assert (row["drafted"], row["accepted"]) == (str(it["drafted"]), str(kept))
            assert row["text"] == f"decode + {it['drafted']} drafts: {kept} kept ●, {rejected} rejected ×"
        else:
            assert row["drafted"] is None
    assert pg.evaluate("() => !document.querySelector('[data-testid=legend-drafts]').hidden")


def test_a_clicked_chart_column_opens_in_the_xray_and_stalls_link_to_their_cause(page):
    objs = trace.load(TRACE)
    pg = page(objs)
    rec = next(r for r in metrics.steps(objs) if any(c["cause"] == "prefill" for c in r["stall_causes"]))
    pg.evaluate("(n) => BS.play.seek(n)", rec["step"])
    pg.wait_for_function("(n) => BS.view.drawn && BS.view.drawn.steps.includes(n)", arg=rec["step"])
    cell = pg.evaluate("(n) => BS.view.drawn.cells.find((c) => c.step === n && c.kind === 'prefill')", rec["step"])
    box = pg.locator("[data-testid=gantt]").bounding_box()
    pg.mouse.click(box["x"] + cell["x"] + cell["w"] / 2, box["y"] + cell["y"] + cell["h"] / 2)
    pg.wait_for_function("(n) => document.querySelector('[data-testid=step-xray]').dataset.step == n", arg=rec["step"])
    pg.evaluate("() => BS.play.resume()")        # live again: the KV map still shows the clicked column
    pg.wait_for_function("(n) => document.querySelector('[data-testid=kv-map]').dataset.step == n", arg=rec["step"])
    links = pg.evaluate("() => BS.stallLinks")
    want = {(rec["step"], c["req"], c["by"]) for c in rec["stall_causes"] if c.get("by")}
    assert want <= {(x["step"], x["req"], x["by"]) for x in links}
    head = pg.evaluate("() => document.querySelector('[data-testid=step-xray] [data-role=head]').textContent")
    assert "Doc" in head and str(rec["stall_causes"][0]["by_tokens"]) in head


def test_views_speak_chinese_and_screenshots(page):
    objs = trace.load(TRACE)
    pg = page(objs)
    rec = next(r for r in metrics.steps(objs) if any(i["kind"] == "decode" for i in r["items"])
               and any(i["kind"] == "prefill" and i["start"] > 0 for i in r["items"]))
    pg.evaluate("(n) => BS.onStepClick(BS.store.steps.find((s) => s.step === n))", rec["step"])
    pg.wait_for_function("(n) => document.querySelector('[data-testid=step-xray]').dataset.step == n", arg=rec["step"])
    pg.wait_for_timeout(600)
    for name in ("cost-model", "step-xray", "stall-causes"):
        pg.locator(f"[data-testid={name}]").screenshot(path=str(screenshot_dir() / f"ui_{name.replace('-', '_')}.png"))
    pg.evaluate("() => BS.setLang('zh')")
    pg.wait_for_function("() => document.querySelector('[data-testid=cost-model] [data-role=caption]')"
                         ".textContent.includes('在')")
    assert "单步透视" in pg.locator("[data-testid=step-xray] h3").text_content()
    assert "被抢占" in pg.locator("[data-testid=stall-causes]").text_content()


def engine_blocks(engine) -> dict:
    """The engine's block tables as the map shows them: block -> (holders, cached), held or cached blocks only."""
    holders: dict[int, list[str]] = {}
    for seq in engine.scheduler.running:
        for b in seq.block_table:
            holders.setdefault(b, []).append(seq.id)
    return {b.id: (sorted(holders.get(b.id, ())), b.hash is not None) for b in engine.block_manager.blocks
            if b.id in holders or b.hash is not None}


def test_kv_map_matches_the_engine_at_paused_steps_through_a_preemption(page):
    from engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=20, block_size=4, seed=0,
                                    policy="chunked", max_num_batched_tokens=16, cpu_threads=1))
    stream: list[dict] = []
    engine.subscribe(stream.append)
    shared = "You are a helpful assistant who answers in one short sentence. "
    for name, q in [("Alice", "Why is the sky blue?"), ("Bob", "What is rain?"), ("Carol", "Name a planet."),
                    ("Dan", "What is a cat?")]:
        engine.add_request(prompt=shared + q, params=SamplingParams(max_tokens=14, ignore_eos=True), label=name)
    truth = {}
    while engine.has_unfinished() and len(truth) < 60:
        rec = engine.step().record
        truth[rec["step"]] = engine_blocks(engine)
    recs = metrics.steps(stream)
    preempted = [r["step"] for r in recs if r["preempted"]]
    shared_blocks = [s for s, m in truth.items() if any(len(h) > 1 for h, _ in m.values())]
    assert preempted and shared_blocks, "the workload should share a prefix and preempt"
    pg = page(stream)
    for step in sorted({shared_blocks[0], preempted[0], preempted[0] + 1, max(truth)}):
        want = {b: (tuple(h), c) for b, (h, c) in truth[step].items()}
        assert analysis.kv_blocks(stream, step) == want
        pg.evaluate("(n) => BS.play.seek(n)", step)
        pg.wait_for_function("(n) => document.querySelector('[data-testid=kv-map]').dataset.step == n", arg=step)
        shown = pg.evaluate("() => BS.kvMapShown()")
        assert {b: (tuple(h), c) for b, h, c in shown["blocks"]} == want, step
    # the preemption frees its victim's blocks: none of them is held by it after that step
    victim = next(r for r in recs if r["preempted"])["preempted"][0]
    assert all(victim not in h for h, _ in truth[preempted[0]].values())
    pg.evaluate("(n) => BS.play.seek(n)", preempted[0])
    pg.wait_for_timeout(500)
    pg.locator("[data-testid=kv-map]").screenshot(path=str(screenshot_dir() / "ui_kv_map.png"))


@pytest.mark.parametrize("total", [20, 2912, 20000])
def test_kv_map_keeps_a_large_cache_in_its_panel_and_names_the_block_under_the_pointer(page, total):
    """Every block is a cell. A small cache keeps 14-px cells with their share counts; a large one's cells
    shrink so the map stays about as tall as the panel beside it (the default CPU cache has 2,912 blocks,
    which at 14 px made a 2,100-px column of empty squares above the what-if panel). Whatever the size, the
    pointer over a cell names that block and its holders, and the cell is drawn in its holder's colour."""
    from tests.factories import arrived, dec, step
    kv = {"used": 2, "total": total, "cached": 1, "block_size": 16}
    held = [{"block": 0, "holders": ["a"], "cached": False},
            {"block": total - 1, "holders": ["a", "b"], "cached": True}]
    pg = page([arrived("a", 0.0), arrived("b", 0.0),
               step(0, 0.0, 0.1, [dec("a"), dec("b")], kv=kv, kv_map=held)])
    pg.wait_for_function("document.querySelector('[data-testid=kv-map]').dataset.step == 0")
    shown = pg.evaluate("BS.kvMapShown()")
    height = pg.evaluate("document.querySelector('[data-testid=kv-map] canvas').getBoundingClientRect().height")
    if total <= 100:
        assert shown["pitch"] == 16
    elif total <= 10_000:
        assert height <= 340, f"{total} blocks drew a map {height:.0f} px tall"
    for b in (0, total - 1):
        col, row = b % shown["cols"], b // shown["cols"]
        x, y = (col + 0.5) * shown["pitch"], (row + 0.5) * shown["pitch"]
        box = pg.locator("[data-testid=kv-map] canvas").bounding_box()
        pg.mouse.move(box["x"] + x, box["y"] + y)
        tip = pg.inner_text("[data-testid=kv-map] [data-role=tip]")
        assert f"block {b} " in tip + " " and "A (a)" in tip, (b, tip)
        rgb = pg.evaluate("([x, y]) => Array.from(document.querySelector('[data-testid=kv-map] canvas')"
                          ".getContext('2d').getImageData(x * devicePixelRatio, y * devicePixelRatio, 1, 1).data)"
                          ".slice(0, 3)", [x, y])
        want = pg.evaluate("BS.colorOf('A')")
        assert "#%02x%02x%02x" % tuple(rgb) == want.lower(), (b, rgb, want)
    pg.mouse.move(0, 0)
