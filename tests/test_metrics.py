"""demos.metrics on synthetic record streams whose answers are known by construction."""
import math

import pytest

from demos import metrics


def step(i, t0, t1, items, budget=256, waiting=0, max_num_seqs=16, **extra):
    return {"type": "step", "step": i, "t_start": t0, "t_end": t1, "policy": "chunked", "token_budget": budget,
            "max_num_seqs": max_num_seqs, "items": items, "num_tokens": sum(x["tokens"] for x in items),
            "finished": [], "preempted": [], "waiting": waiting, "running": len(items), **extra}


def dec(req, start=10):
    return {"req": req, "label": req.upper(), "kind": "decode", "tokens": 1, "start": start}


def pre(req, n, start, prompt_len, cached=None):
    item = {"req": req, "label": req.upper(), "kind": "prefill", "tokens": n, "start": start,
            "prompt_len": prompt_len, "completes_prompt": start + n == prompt_len}
    if cached:
        item["cached"] = cached
    return item


def arrived(req, t):
    return {"type": "request", "event": "arrived", "req": req, "label": req.upper(), "t": t}


def stall_stream(stall_s=1.0, tick=0.01):
    """a: arrives at 0, prefill in step 0, decodes steps 1-4; step 5 is b's whole prefill (a left out);
    a decodes again in steps 6-7. Each step lasts `tick` except step 5, which lasts `stall_s`."""
    s, t = [arrived("a", 0.0)], 0.0
    for i in range(8):
        dt = stall_s if i == 5 else tick
        if i == 0:
            items = [pre("a", 20, 0, 20)]
        elif i == 5:
            items = [pre("b", 500, 0, 500)]
        else:
            items = [dec("a")] + ([dec("b")] if i > 5 else [])
        s.append(step(i, t, t + dt, items))
        t += dt
        if i == 4:
            s.append(arrived("b", t))
    return s


def test_a_stall_of_known_length_is_the_tbt_max():
    s = stall_stream(stall_s=1.0, tick=0.01)
    tbt = metrics.tbts(s)
    # a's tokens end steps 0,1,2,3,4,6,7: the gap across step 5 spans that step and step 6
    assert tbt["a"] == pytest.approx([0.01, 0.01, 0.01, 0.01, 1.0 + 0.01, 0.01])
    assert metrics.stalls(s)["a"] == [(6, pytest.approx(1.01))]
    summary = metrics.summarize(s, reqs=["a"])
    assert summary["tbt_max_s"] == pytest.approx(1.01)
    assert summary["stall_max_s"] == pytest.approx(1.01)
    assert summary["stall_count"] == 1
    assert summary["tbt_p50_s"] == pytest.approx(0.01)


def test_a_slow_step_that_includes_the_request_is_no_stall():
    """Chunked prefill: the long prompt's chunk rides along with a's decode; a is slowed, never left out."""
    s = stall_stream(stall_s=0.3)
    s = [dict(r, items=[dec("a")] + r["items"]) if r.get("type") == "step" and r["step"] == 5 else r for r in s]
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
    from demos.report import segments
    s = stall_stream(stall_s=1.0, tick=0.01)
    segs = [x for x in segments(s) if x["req"] == "a"]
    kinds = sorted((x["kind"], round(x["start"], 3), round(x["end"], 3), x["tokens"]) for x in segs)
    # prefill in step 0; decodes in steps 1-4 merged; left out in step 5 (the stall); decodes 6-7 merged
    assert kinds == [("decode", 0.01, 0.05, 4), ("decode", 1.05, 1.07, 2), ("prefill", 0.0, 0.01, 20),
                     ("stall", 0.05, 1.05, 0)]
