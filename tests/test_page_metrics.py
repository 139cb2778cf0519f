"""The page's metrics table against app/readers/metrics.py, number by number, in a real browser.

A recorded trace (tests/data/page_trace.json, made by `python -m tests.record_trace`:
the default model under chunked, continuous and static batching, with stalls and
a preemption) and synthetic streams are replayed into the stage offline (no
server: the stage's HTML and scripts, fed through BS.ingestAll as a trace file
would be). Every cell must hold the numbers app.readers.metrics.stretches() gives for
the same stream, and show them formatted as the page formats them.
"""
from pathlib import Path

import pytest

from app.readers import metrics
from demos.compare import trace
from tests.browser import MARKS, chromium, load_stage
from tests.factories import random_streams
from tests.page_table import TABLE_JS, check

TRACE = Path(__file__).parent / "data" / "page_trace.json"
pytestmark = MARKS


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


def test_recorded_speculative_trace_page_table_matches_python(stage):
    """A real speculative run (tests/data/spec_trace.json, `python -m tests.record_spec_trace`): the same
    traffic without then with n-gram drafts, two stretches, the acceptance line in both."""
    objs = trace.load(Path(__file__).parent / "data" / "spec_trace.json")
    off, on = metrics.stretches(objs)
    assert off["draft_tokens"] == 0 and 0 < on["accepted_tokens"] < on["draft_tokens"]
    assert off["output_tokens"] == on["output_tokens"]          # the same replies, in fewer steps
    assert on["num_steps"] < off["num_steps"]
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


def test_random_speculative_streams_page_table_matches_python(stage):
    """Speculative decoding: decodes that verify drafts give 1 + accepted tokens each, the acceptance line
    shows, and a change of the drafts' bound starts a stretch, on the page as in Python."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(random_streams(speculative=True))
    def one(s):
        check(stage(s), s)

    one()


def test_a_verifying_decode_counts_its_accepted_tokens():
    """Python's side alone: 1 + accepted tokens at the step's end, the first with the gap, the rest 0 s apart."""
    from tests.factories import arrived, dec, pre, step
    s = [arrived("a", 0.0), step(0, 0.0, 0.1, [pre("a", 4, 0, 4)]),
         step(1, 0.1, 0.3, [dec("a", 4, drafted=3, accepted=2)], speculative=3),
         step(2, 0.3, 0.4, [dec("a", 7, drafted=3, accepted=0)], speculative=3),
         step(3, 0.4, 0.5, [dec("a", 8)])]
    assert metrics.tbts(s)["a"] == pytest.approx([0.2, 0.0, 0.0, 0.1, 0.1])
    m = metrics.stretches(s)
    assert [x["speculative"] for x in m] == [None, 3, None]
    assert (m[1]["output_tokens"], m[1]["draft_tokens"], m[1]["accepted_tokens"]) == (4, 6, 2)
    assert m[1]["acceptance_rate"] == pytest.approx(2 / 6) and m[0]["acceptance_rate"] is None
    assert metrics.summarize(s)["acceptance_rate"] == pytest.approx(2 / 6)
    assert metrics.summarize(s)["tbt_mean_s"] == pytest.approx(0.4 / 5)


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
