"""The KV-transfer line of app.readers.metrics (disaggregated): per run and per stretch, on streams whose
answers are known by construction, and on random ones against a direct count."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.readers import metrics
from tests.factories import arrived, dec, pre, step


def moved(req, t, seconds, blocks=2):
    return {"type": "request", "event": "kv_transfer", "req": req, "label": req.upper(), "t": t,
            "blocks": blocks, "bytes": blocks * 1000, "seconds": seconds, "from_worker": "prefill",
            "to_worker": "decode"}


def test_transfers_per_run_and_per_stretch():
    s = [arrived("a", 0.0), arrived("b", 0.0), arrived("c", 2.0),
         step(0, 0.0, 0.5, [pre("a", 8, 0, 8)]),                          # one engine: no transfers
         step(1, 0.5, 1.0, [dec("a"), pre("b", 8, 0, 8)]),
         step(2, 2.0, 2.4, [pre("c", 16, 0, 16)], policy="disaggregated", worker="prefill"),
         moved("c", 2.5, 0.1, blocks=1),
         step(3, 2.1, 2.6, [dec("a")], policy="disaggregated", worker="decode"),
         moved("b", 2.7, 0.3, blocks=3),
         step(4, 2.6, 3.0, [dec("b"), dec("c")], policy="disaggregated", worker="decode"),
         moved("a", 3.5, 9.0)]                                              # after the last step: in no stretch
    first, second = metrics.stretches(s)
    assert (first["transfers"], first["transfer_p50_s"], first["transfer_bytes"]) == (0, None, 0)
    assert second["transfers"] == 2 and second["transfer_bytes"] == 4000
    assert second["transfer_p50_s"] == pytest.approx(0.2) and second["transfer_p99_s"] == pytest.approx(0.298)
    whole = metrics.summarize(s)
    assert whole["kv_transfers"] == 3 and whole["kv_transfer_bytes"] == 6000
    assert whole["kv_transfer_p50_s"] == pytest.approx(0.3)


def test_a_transfer_on_the_boundary_of_two_stretches_counts_once_in_the_earlier():
    """The property test below found it: stretches meet at t = 1.0 (one ends, the next starts) and a
    hand-over ends exactly then; both stretches' spans hold it, and it was counted in both."""
    s = [step(0, 0.0, 1.0, [dec("a")]), step(1, 1.0, 1.5, [dec("a")], policy="disaggregated"),
         moved("r", 1.0, 0.2, blocks=1)]
    first, second = metrics.stretches(s)
    assert (first["transfers"], second["transfers"]) == (1, 0)
    assert metrics.summarize(s)["kv_transfers"] == 1


@st.composite
def streams_with_transfers(draw):
    s, t = [], 0.0
    for i in range(draw(st.integers(1, 30))):
        policy = draw(st.sampled_from(["chunked", "disaggregated"]))
        dt, gap = draw(st.floats(0.001, 1.0)), draw(st.sampled_from([0.0, 0.0, 0.5]))
        t += gap
        s.append(step(i, t, t + dt, [dec("a")], policy=policy))
        if draw(st.booleans()):
            s.append(moved(f"r{i}", draw(st.floats(t - 0.6, t + dt + 0.6)), draw(st.floats(0.0, 2.0)),
                           draw(st.integers(1, 40))))
        t += dt
    return s


@settings(max_examples=150, deadline=None)
@given(streams_with_transfers())
def test_each_transfer_counts_once_in_the_stretch_whose_span_holds_its_end(s):
    parts = metrics.stretches(s)
    events = metrics.events(s, "kv_transfer")
    after = None                        # t_end of the step before the stretch
    for p in parts:
        recs = [r for r in metrics.steps(s) if p["first_step"] <= r["step"] <= p["last_step"]]
        mine = [e for e in events if recs[0]["t_start"] <= e["t"] <= recs[-1]["t_end"]
                and (after is None or e["t"] > after)]
        after = recs[-1]["t_end"]
        assert p["transfers"] == len(mine) and p["transfer_bytes"] == sum(e["bytes"] for e in mine)
        if mine:
            lo, hi = min(e["seconds"] for e in mine), max(e["seconds"] for e in mine)
            assert lo <= p["transfer_p50_s"] <= p["transfer_p99_s"] <= hi
        else:
            assert p["transfer_p50_s"] is None
    assert sum(p["transfers"] for p in parts) <= metrics.summarize(s)["kv_transfers"] == len(events)


def test_recorded_disaggregated_trace():
    """tests/data/disagg_trace.json (python -m tests.record_disagg_trace, the real engine): prefill steps
    and decode steps overlap in time on their two workers, one hand-over per request that decoded,
    each stretch's transfers within its time span, steps numbered as one stream."""
    from pathlib import Path

    from demos.compare import trace
    objs = trace.load(Path(__file__).parent / "data" / "disagg_trace.json")
    steps = metrics.steps(objs)
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + len(steps)))
    lanes = {w: [s for s in steps if s["worker"] == w] for w in ("prefill", "decode")}
    assert all(i["kind"] == "prefill" for s in lanes["prefill"] for i in s["items"])
    assert all(i["kind"] == "decode" for s in lanes["decode"] for i in s["items"])
    assert any(a["t_start"] < b["t_end"] and b["t_start"] < a["t_end"]
               for a in lanes["prefill"] for b in lanes["decode"])
    decoded = {i["req"] for s in lanes["decode"] for i in s["items"]}
    moved = metrics.events(objs, "kv_transfer")
    assert sorted(e["req"] for e in moved) == sorted(decoded)
    parts = metrics.stretches(objs)
    assert len(parts) == 2 and all(p["transfers"] > 0 for p in parts)
    assert sum(p["transfers"] for p in parts) == metrics.summarize(objs)["kv_transfers"] == len(moved)
