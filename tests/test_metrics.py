"""app.readers.metrics on synthetic record streams whose answers are known by construction."""
import math

import pytest

from app.readers import metrics
from tests.factories import arrived, dec, pre, random_streams, stall_stream, step


def test_a_stall_of_known_length_is_the_tbt_max():
    s = stall_stream(stall_s=1.0, tick=0.01)
    tbt = metrics.tbts(s)
    # a's tokens end steps 0,1,2,3,4,6,7: the gap across step 5 spans that step and step 6
    assert tbt["a"] == pytest.approx([0.01, 0.01, 0.01, 0.01, 1.0 + 0.01, 0.01])
    assert [(tk.step, tk.gap) for tk in metrics.stalls(s)["a"]] == [(6, pytest.approx(1.01))]
    summary = metrics.summarize(s, reqs=["a"])
    assert summary["tbt_max_s"] == pytest.approx(1.01)
    assert summary["stall_max_s"] == pytest.approx(1.01)
    assert summary["stall_count"] == 1
    assert summary["tbt_p50_s"] == pytest.approx(0.01)


def test_a_slow_step_that_includes_the_request_is_no_stall():
    """Chunked prefill: the long prompt's chunk rides along with a's decode; a is slowed, never left out."""
    s = stall_stream(stall_s=0.3)
    s = [dict(r, items=[dec("a")] + r["items"], stalled=[]) if r.get("type") == "step" and r["step"] == 5 else r
         for r in s]
    assert metrics.stalls(s)["a"] == []
    m = metrics.summarize(s, reqs=["a"])
    assert m["tbt_max_s"] == pytest.approx(0.3) and m["stall_max_s"] == 0.0 and m["stall_count"] == 0


def test_ttft_counts_from_arrival_to_the_step_that_completes_the_prompt():
    s = [arrived("x", 0.5),
         step(0, 0.6, 0.7, [pre("x", 100, 0, 300)]),          # chunk 1 of 3: no token
         step(1, 0.7, 0.8, [pre("x", 100, 100, 300)]),
         step(2, 0.8, 0.95, [pre("x", 100, 200, 300)]),       # completes the prompt: first token
         step(3, 0.95, 1.0, [dec("x")])]
    assert metrics.token_times(s) == {"x": [0.95, 1.0]}
    assert metrics.ttfts(s) == {"x": pytest.approx(0.45)}
    assert metrics.tbts(s) == {"x": [pytest.approx(0.05)]}


def test_throughput_budget_fill_preemptions_and_cache():
    s = [arrived("a", 1.0), arrived("b", 1.0),
         step(0, 1.0, 2.0, [pre("a", 64, 0, 64), pre("b", 64, 0, 128, cached=64)], budget=128, waiting=1),
         step(1, 2.0, 3.0, [dec("a"), pre("b", 64, 64, 128)], budget=128, preempted=["c"]),
         step(2, 3.0, 5.0, [dec("a"), dec("b")], budget=128)]
    m = metrics.summarize(s)
    assert m["output_tokens"] == 5            # a: steps 0,1,2; b: steps 1,2
    assert m["duration_s"] == pytest.approx(4.0)
    assert m["output_tokens_per_s"] == pytest.approx(5 / 4.0)
    assert [f for _, _, f in metrics.budget_fill(s)] == pytest.approx([1.0, 65 / 128, 2 / 128])
    assert m["budget_fill_mean"] == pytest.approx((1.0 + 65 / 128 + 2 / 128) / 3)
    assert m["num_steps"] == 3 and m["num_preemptions"] == 1
    assert m["cached_prompt_tokens"] == 64
    assert m["idle_slots_while_waiting"] == 16 - 2   # only step 0 had a request waiting


def test_percentile_interpolates_like_numpy():
    assert metrics.percentile([4, 1, 3, 2], 50) == 2.5
    assert metrics.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert metrics.percentile([1, 2, 3, 4], 0) == 1 and metrics.percentile([1, 2, 3, 4], 100) == 4
    assert metrics.percentile([7.0], 99) == 7.0
    assert metrics.percentile([], 50) is None
    xs = [math.sin(i) for i in range(101)]
    assert metrics.percentile(xs, 37) == sorted(xs)[37]


def test_p99_catches_three_stalls_in_a_hundred_and_eighty_nine_gaps():
    """The headline workload's shape: 3 victims x 64 tokens, each stalled once."""
    gaps = [0.02] * 186 + [2.0, 2.0, 2.0]
    assert metrics.percentile(gaps, 99) == pytest.approx(2.0)
    assert metrics.percentile(gaps, 50) == pytest.approx(0.02)


def test_decoding_at_and_focus_summary():
    s = stall_stream(stall_s=0.5)
    t_b = metrics.arrivals(s)["b"]
    assert metrics.decoding_at(s, t_b) == ["a"]
    f = metrics.focus_summary(s, "b")
    assert f["victims"] == ["a"] and f["victim_labels"] == ["A"]
    assert f["tbt_max_s"] == pytest.approx(0.51) and f["stall_count"] == 1
    assert f["focus_ttft_s"] == pytest.approx(0.5)   # b arrives at the end of step 4, first token ends step 5
    assert metrics.decoding_at(s, -1.0) == []


def test_empty_and_foreign_objects_are_ignored():
    m = metrics.summarize([{"type": "policy", "t": 0.0}, {"type": "trace", "version": 1}])
    assert m["output_tokens"] == 0 and m["tbt_p99_s"] is None and m["output_tokens_per_s"] is None
    assert m["stall_max_s"] is None


def test_tbt_series_and_cdf():
    s = stall_stream(stall_s=1.0)
    rows = metrics.tbt_series(s, reqs=["a"])
    assert len(rows) == 6 and all(req == "a" for _, _, req in rows)
    assert [t for t, _, _ in rows] == sorted(t for t, _, _ in rows)
    x, y = metrics.cdf([3, 1, 2])
    assert x == [1, 2, 3] and y == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_gantt_segments_merge_steps_and_mark_stalls():
    from app.readers.report import segments
    s = stall_stream(stall_s=1.0, tick=0.01)
    segs = [x for x in segments(s) if x["req"] == "a"]
    kinds = sorted((x["kind"], round(x["start"], 3), round(x["end"], 3), x["tokens"]) for x in segs)
    # prefill in step 0; decodes in steps 1-4 merged; left out in step 5 (the stall); decodes 6-7 merged
    assert kinds == [("decode", 0.01, 0.05, 4), ("decode", 1.05, 1.07, 2), ("prefill", 0.0, 0.01, 20),
                     ("stall", 0.05, 1.05, 0)]


def test_the_wait_after_a_preemption_is_a_gap_not_a_stall():
    """a is preempted in step 2 (not running, so in no step's `stalled`), recomputed in step 4."""
    s = [arrived("a", 0.0), arrived("b", 0.0),
         step(0, 0.0, 0.1, [pre("a", 8, 0, 8), pre("b", 8, 0, 8)]),
         step(1, 0.1, 0.2, [dec("a"), dec("b")]),
         step(2, 0.2, 0.3, [dec("b")], preempted=["a"], waiting=1),
         step(3, 0.3, 0.4, [dec("b")], waiting=1),
         step(4, 0.4, 0.6, [pre("a", 10, 0, 10)], stalled=["b"]),     # recompute: prompt + 2 outputs; b left out
         step(5, 0.6, 0.7, [dec("a"), dec("b")])]
    tk = metrics.tokens(s)
    assert [x.gap for x in tk["a"]] == [None, pytest.approx(0.1), pytest.approx(0.4), pytest.approx(0.1)]
    assert [x.stalled for x in tk["a"]] == [False] * 4
    assert [(x.step, x.gap) for x in metrics.stalls(s)["b"]] == [(5, pytest.approx(0.3))]
    m = metrics.summarize(s)
    assert m["stall_count"] == 1 and m["stall_max_s"] == pytest.approx(0.3)
    assert m["tbt_max_s"] == pytest.approx(0.4) and m["num_preemptions"] == 1


def test_missing_records_make_no_stall():
    """A viewer that fell behind lacks steps 2-3; the step numbers jump but no step said 'left out'."""
    s = [r for r in stall_stream(stall_s=0.2) if r.get("step") not in (2, 3)]
    s = [dict(r, stalled=[]) if r.get("type") == "step" else r for r in s]
    assert metrics.stalls(s)["a"] == []
    assert metrics.tbts(s)["a"][1] == pytest.approx(0.03)     # steps 1 -> 4: still one gap


def test_stretches_split_at_each_setting_change():
    s = stall_stream(stall_s=1.0, tick=0.01)
    s = [dict(r, policy="continuous") if r.get("type") == "step" and r["step"] >= 5 else r for r in s]
    first, second = metrics.stretches(s)
    assert (first["policy"], first["first_step"], first["last_step"], first["num_steps"]) == ("chunked", 0, 4, 5)
    assert (second["policy"], second["first_step"], second["last_step"]) == ("continuous", 5, 7)
    assert first["output_tokens"] == 5 and second["output_tokens"] == 5      # a: 0-4 | a: 6, 7; b: 5, 6, 7
    assert first["ttft_p50_s"] == pytest.approx(0.01) and second["ttft_p50_s"] == pytest.approx(1.0)
    assert first["stall_max_s"] == 0.0 and second["stall_max_s"] == pytest.approx(1.01)
    assert second["longest_gap_s"] == pytest.approx(1.01)
    assert first["output_tokens_per_s"] == pytest.approx(5 / 0.05)
    assert first["kv_used_max"] == pytest.approx(4 / 64) and second["busy_s"] == pytest.approx(1.02)
    # the cap on one prompt's chunk is part of the setting too: a change of it alone starts a new stretch
    capped = [dict(r, max_prefill_chunk=4) if r.get("type") == "step" and r["step"] >= 5 else r
              for r in stall_stream(stall_s=1.0, tick=0.01)]
    first, second = metrics.stretches(capped)
    assert (first["max_prefill_chunk"], second["max_prefill_chunk"]) == (None, 4)
    assert (first["last_step"], second["first_step"]) == (4, 5) and first["policy"] == second["policy"]


# ---- searched: many random cases ----
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=60), st.floats(0, 100))
def test_percentile_is_numpy_linear(xs, q):
    np = pytest.importorskip("numpy")
    got = metrics.percentile(xs, q)
    if not xs:
        assert got is None
    else:
        assert got == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)
        assert min(xs) <= got <= max(xs)


@settings(max_examples=150, deadline=None)
@given(random_streams())
def test_tokens_stalls_and_stretches_agree_with_a_direct_count(s):
    recs = metrics.steps(s)
    tk = metrics.tokens(s)
    for req, tks in tk.items():
        for prev, cur in zip(tks, tks[1:]):
            between = [r for r in recs if prev.step < r["step"] < cur.step]
            assert cur.gap == pytest.approx(cur.t - prev.t)
            assert cur.stalled == any(req in r["stalled"] for r in between)
            if cur.stalled:        # a stall lasts at least the steps that left the request out
                assert cur.gap >= sum(r["t_end"] - r["t_start"] for r in between if req in r["stalled"]) - 1e-9
    m, parts = metrics.summarize(s), metrics.stretches(s)
    assert sum(p["num_steps"] for p in parts) == m["num_steps"]
    assert sum(p["output_tokens"] for p in parts) == m["output_tokens"]
    assert max((p["stall_max_s"] for p in parts), default=0.0) == pytest.approx(m["stall_max_s"] or 0.0)
    assert all(a["last_step"] < b["first_step"]
               for a, b in zip(parts, parts[1:]))
    keys = ("policy", "token_budget", "max_num_seqs", "prefix_caching", "max_kv_blocks", "max_prefill_chunk")
    assert all(tuple(a[k] for k in keys) != tuple(b[k] for k in keys) for a, b in zip(parts, parts[1:]))


@settings(max_examples=150, deadline=None)
@given(random_streams())
def test_the_apps_lesson_messages_move_no_number(s):
    """The lesson messages the app puts in the stream (app/ui/lessons.py) are not records: every number is
    the same with them as without."""
    plain = [o for o in s if o.get("type") != "lesson"]
    assert metrics.summarize(s) == metrics.summarize(plain) and metrics.stretches(s) == metrics.stretches(plain)
    assert metrics.tokens(s) == metrics.tokens(plain)


def test_a_first_token_is_never_a_stall():
    """Only a gap can be a stall: a (malformed) `stalled` entry before the first token is ignored."""
    s = [arrived("a", 0.0), step(0, 0.0, 0.1, [], stalled=["a"]), step(1, 0.1, 0.2, [pre("a", 4, 0, 4)]),
         step(2, 0.2, 0.3, [dec("a")])]
    assert [tk.stalled for tk in metrics.tokens(s)["a"]] == [False, False]
    assert metrics.summarize(s)["stall_count"] == 0 and metrics.stretches(s)[0]["stall_max_s"] == 0.0


@settings(max_examples=150, deadline=None)
@given(random_streams(), st.data())
def test_the_live_meter_reads_a_stream_record_by_record_as_stretches_reads_it_whole(s, data):
    """What the server keeps for late viewers (app/serving/broadcast.py): read while the run goes on, at any
    moments, it always gives what stretches() gives for the records so far."""
    meter = metrics.StretchMeter()
    for i, rec in enumerate(s):
        meter.observe(rec)
        if data.draw(st.booleans()):
            assert meter.stretches() == metrics.stretches(s[:i + 1])
    assert meter.stretches() == metrics.stretches(s)


def test_prefix_hit_rate_and_preemptions_per_stretch_known_by_construction():
    """a reads 40 prompt tokens, b finds 32 of its 40 cached; then caching goes off: c reads all 40 and
    is preempted and read again (a read of its own). Two stretches: 32/80 hits, then 0/(40 + 41)."""
    s = [arrived("a", 0.0), arrived("b", 0.0), arrived("c", 0.0),
         step(0, 0.0, 0.1, [pre("a", 40, 0, 40)]),
         step(1, 0.1, 0.2, [dec("a"), pre("b", 8, 32, 40, cached=32)]),
         step(2, 0.2, 0.3, [pre("c", 20, 0, 40)], prefix_caching=False),
         step(3, 0.3, 0.4, [pre("c", 20, 20, 40)], prefix_caching=False),
         step(4, 0.4, 0.5, [dec("c")], prefix_caching=False, preempted=["c"]),
         step(5, 0.5, 0.6, [pre("c", 41, 0, 41)], prefix_caching=False)]
    on, off = metrics.stretches(s)
    assert on["prefix_caching"] is True and on["prefix_hit_rate"] == pytest.approx(32 / 80)
    assert off["prefix_caching"] is False and off["prefix_hit_rate"] == 0.0 and off["preemptions"] == 1
    assert on["preemptions"] == 0 and on["max_kv_blocks"] is None


def test_the_reports_table_shows_the_budget_fill_as_a_percentage():
    """The report's table says the mean budget fill as the page says a share (a percentage), not as 0.0892."""
    from app.readers.report import metrics_table
    table = metrics_table({"static": {"budget_fill_mean": 0.0892}, "chunked": {"budget_fill_mean": 0.204}})
    assert "<tr><th>budget fill, mean (%)</th><td>8.9</td><td>20.4</td></tr>" in table
