"""The page's metrics table against app/readers/metrics.py, number by number, in a real browser.

A recorded trace (tests/data/page_trace.json, made by `python -m tests.record_trace`:
the default model under chunked, continuous and static batching, with stalls and
a preemption) and synthetic streams are replayed into the stage offline (no
server: the stage's HTML and scripts, fed through BS.ingestAll as a trace file
would be). Every cell must hold the numbers app.readers.metrics.stretches() gives for
the same stream, and show them formatted as the page formats them.
"""
import math
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from tests.browser import MARKS, chromium, load_stage

from demos import trace
from app.readers import metrics
from tests.factories import random_streams

TRACE = Path(__file__).parent / "data" / "page_trace.json"
pytestmark = MARKS
ROWS = ["steps", "ttft", "tbt", "stall", "tps", "kv", "waiting"]
MAX_COLUMNS = 4         # the page shows the newest four stretches
# the metrics table's columns as the page shows them: per row, the text and the numbers behind it
TABLE_JS = """() => {
    const t = document.querySelector('[data-testid=metrics] table');
    return [...t.tHead.rows[0].querySelectorAll('th[data-policy]')].map((th, i) => {
        const col = {policy: th.dataset.policy};
        for (const tr of t.querySelectorAll('tr[data-metric]')) {
            const td = tr.cells[i + 1];
            col[tr.dataset.metric] = {text: td.textContent, values: JSON.parse(td.dataset.values)};
        }
        return col;
    });
}"""


@pytest.fixture(scope="module")
def stage():
    """A page with the stage loaded offline; call it with a stream, get the table's cells."""
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))

        def show(stream: list[dict]) -> list[dict]:
            load_stage(page, stream, "window.BS && BS.store && document.querySelector('[data-testid=metrics] table')")
            page.wait_for_function("document.querySelector('[data-testid=metrics] tr[data-metric=steps] td')")
            assert not errors, errors
            return page.evaluate(TABLE_JS)

        yield show


def fixed(x: float, digits: int) -> str:
    """JavaScript's Number.toFixed: the exact binary value rounded half up (Python's format rounds half to even)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def sec(v):
    """The page's time format (static/metrics.js)."""
    return "–" if v is None else fixed(v * 1000, 0) + " ms" if v < 1 else fixed(v, 2) + " s"


def size(n: int) -> str:
    """The page's byte format (static/draw.js BS.fmtBytes)."""
    return fixed(n / 1e6, 1) + " MB" if n >= 1e6 else fixed(n / 1e3, 0) + " kB" if n >= 1e3 else f"{n} B"


def expected(m: dict) -> dict:
    """app.readers.metrics.stretches() output as the page's rows: (numbers, text)."""
    rows = {
        "steps": ([m["first_step"], m["last_step"], m["num_steps"]],
                  f"{m['first_step']}–{m['last_step']} ({m['num_steps']})"),
        "ttft": ([m["ttft_p50_s"], m["ttft_p99_s"]], f"{sec(m['ttft_p50_s'])} / {sec(m['ttft_p99_s'])}"),
        "tbt": ([m["tbt_p50_s"], m["tbt_p99_s"]], f"{sec(m['tbt_p50_s'])} / {sec(m['tbt_p99_s'])}"),
        "stall": ([m["stall_max_s"]], sec(m["stall_max_s"]) if m["stall_max_s"] > 0 else "0"),
        "tps": ([m["output_tokens_per_s"]],
                "–" if m["output_tokens_per_s"] is None else fixed(m["output_tokens_per_s"], 1)),
        "kv": ([m["kv_used_max"]], fixed(m["kv_used_max"] * 100, 1) + " %"),
        "waiting": ([m["waiting_max"]], str(m["waiting_max"])),
        "transfer": ([m["transfers"], m["transfer_p50_s"], m["transfer_p99_s"], m["transfer_bytes"]],
                     f"{m['transfers']} · {sec(m['transfer_p50_s'])} / {sec(m['transfer_p99_s'])} · "
                     f"{size(m['transfer_bytes'])}" if m["transfers"] else "–"),
    }
    return rows


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-12,
                                                                                          abs_tol=1e-12))


def check(page_cols: list[dict], stream: list[dict]):
    want = metrics.stretches(stream)[-MAX_COLUMNS:]
    assert [c["policy"] for c in page_cols] == [m["policy"] for m in want]
    handed_over = any(m["transfers"] for m in want)       # the KV hand-over line shows only then
    for col, m in zip(page_cols, want):
        assert ("transfer" in col) == handed_over
        for row, (values, text) in expected(m).items():
            if row == "transfer" and not handed_over:
                continue
            got = col[row]
            assert len(got["values"]) == len(values) and all(map(same, got["values"], values)), (m["policy"], row,
                                                                                                 got, values)
            assert got["text"] == text, (m["policy"], row, got["text"], text)


def test_recorded_trace_page_table_matches_python(stage):
    objs = trace.load(TRACE)
    s = metrics.summarize(objs)
    assert s["stall_count"] > 0 and s["num_preemptions"] > 0 and len(metrics.stretches(objs)) == 3
    check(stage(objs), objs)


def test_recorded_disaggregated_trace_page_table_matches_python(stage):
    """A real disaggregated run (tests/data/disagg_trace.json, `python -m tests.record_disagg_trace`):
    two stretches with KV hand-overs, the transfer line in both."""
    objs = trace.load(Path(__file__).parent / "data" / "disagg_trace.json")
    assert all(m["transfers"] for m in metrics.stretches(objs)) and len(metrics.stretches(objs)) == 2
    check(stage(objs), objs)


def test_preemption_stream_page_table_matches_python(stage):
    """The case the two old stall definitions disagreed on: a's wait after its preemption."""
    from tests.factories import arrived, dec, pre, step
    s = [arrived("a", 0.0), arrived("b", 0.0),
         step(0, 0.0, 0.1, [pre("a", 8, 0, 8), pre("b", 8, 0, 8)]),
         step(1, 0.1, 0.2, [dec("a"), dec("b")]),
         step(2, 0.2, 0.3, [dec("b")], preempted=["a"], waiting=1),
         step(3, 0.3, 0.4, [dec("b")], waiting=1),
         step(4, 0.4, 1.6, [pre("a", 10, 0, 10)], stalled=["b"]),
         step(5, 1.6, 1.7, [dec("a"), dec("b")])]
    assert metrics.stretches(s)[0]["stall_max_s"] == pytest.approx(1.3)   # b's, not a's 1.4 s gap
    check(stage(s), s)


def test_random_streams_page_table_matches_python(stage):
    """Many engine-shaped random streams (settings changing, stalls, preemptions) through the page."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(random_streams())
    def one(s):
        check(stage(s), s)

    one()


def test_random_kv_hand_overs_page_table_matches_python(stage):
    """Random streams with KV hand-overs at random times (some on a stretch's first t_start or last t_end,
    some outside every stretch): the page's transfer line counts the same ones as Python's."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @st.composite
    def with_hand_overs(draw):
        s = draw(random_streams())
        recs = metrics.steps(s)
        edges = [r["t_start"] for r in recs] + [r["t_end"] for r in recs]
        for k in range(draw(st.integers(0, 6))):            # one hand-over per request, as the engine makes them
            t = draw(st.one_of(st.sampled_from(edges), st.floats(-0.5, recs[-1]["t_end"] + 0.5)))
            blocks = draw(st.integers(1, 200))
            s.append({"type": "request", "event": "kv_transfer", "req": f"x{k}", "label": f"X{k}", "t": t,
                      "blocks": blocks, "bytes": blocks * 737_280, "seconds": draw(st.floats(0.0, 2.0)),
                      "from_worker": "prefill", "to_worker": "decode"})
        return s

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(with_hand_overs())
    def one(s):
        check(stage(s), s)

    one()
