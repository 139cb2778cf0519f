"""app/readers/analysis.py: the step-cost fit and the stall causes, on streams with known answers and a
recorded trace."""
import math
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.readers import analysis, metrics
from demos.compare import trace
from engine.outputs.records import KV_MAP_EVERY, kv_map, kv_ops
from tests.factories import arrived, cost_step, dec, linear_stream, pre, step
from tests.scheduler_workload import Case

WHY_TRACE = Path(__file__).parent / "data" / "why_trace.json"
GPU_TRACE = Path(__file__).resolve().parent.parent / "static" / "data" / "gpu_cost_trace.json"


# ---- the fit ----
def test_exact_linear_data_gives_its_coefficients_and_r2_one():
    shapes = [([5, 9], None), ([3], (0, 20)), ([], (0, 40)), ([100, 7, 8], (20, 16)), ([50], None), ([], (40, 8))]
    fit = analysis.fit_stream(linear_stream(0.02, 0.001, 0.00002, shapes))[0]
    assert fit.terms == 3 and fit.n == 6 and fit.device == "cpu/float32"
    assert math.isclose(fit.a, 0.02, rel_tol=1e-6) and math.isclose(fit.b, 0.001, rel_tol=1e-6)
    assert math.isclose(fit.c, 0.00002, rel_tol=1e-5) and math.isclose(fit.r2, 1.0)


def test_context_that_cannot_be_told_apart_from_tokens_is_dropped():
    # prefill-only steps from position 0: context == tokens, so only a + b*tokens can be fitted
    fit = analysis.fit_stream(linear_stream(0.01, 0.002, 0.0, [([], (0, n)) for n in (4, 8, 16, 30)]))[0]
    assert fit.terms == 2 and fit.c == 0.0
    assert math.isclose(fit.a, 0.01, rel_tol=1e-9) and math.isclose(fit.b, 0.002, rel_tol=1e-9)
    # one shape only: the mean
    fit = analysis.fit_stream(linear_stream(0.05, 0.0, 0.0, [([3], None)] * 3))[0]
    assert fit.terms == 1 and math.isclose(fit.a, 0.05)
    same = [analysis.CostPoint(i, 0.05, 1, 4, "decode") for i in range(3)]
    assert analysis.fit_cost(same).r2 is None and analysis.fit_cost([]) is None


def test_fits_are_per_device_and_skip_failed_and_empty_steps():
    cpu = linear_stream(0.02, 0.001, 0.0, [([1], None), ([], (0, 9)), ([2, 3], (4, 5))])
    gpu = linear_stream(0.008, 0.00001, 0.0, [([1], None), ([], (0, 9)), ([2, 3], (4, 5))], device="cuda/bfloat16")
    gpu = [dict(r, step=r["step"] + 10) for r in gpu]
    junk = [cost_step(30, 9.0, [dec("x", 3)], failed=True), cost_step(31, 9.0, [])]
    fits = analysis.fit_stream(cpu + gpu + junk)
    assert [f.device for f in fits] == ["cpu/float32", "cuda/bfloat16"] and [f.n for f in fits] == [3, 3]
    assert analysis.regime(fits[0], 256) == "proportional" and analysis.regime(fits[1], 256) == "flat"


@settings(max_examples=60)
@given(a=st.floats(0.001, 0.1), b=st.floats(1e-5, 1e-2), c=st.floats(0, 1e-4),
       shapes=st.lists(st.tuples(st.lists(st.integers(0, 500), max_size=6),
                                 st.one_of(st.none(), st.tuples(st.integers(0, 300), st.integers(1, 64)))),
                       min_size=5, max_size=40).filter(lambda s: all(d or c for d, c in s)))
# every step has the same token count and only the context tells them apart: the fit must keep context
@example(a=0.0625, b=0.0078125, c=5.665702300298049e-05, shapes=[([0] * 6, None)] * 4 + [([0] * 5 + [1], None)])
def test_the_fit_reproduces_any_linear_stream(a, b, c, shapes):
    pts = analysis.cost_points(linear_stream(a, b, c, shapes))
    fit = analysis.fit_cost(pts)
    for p in pts:    # whatever terms it kept, the fit predicts every step
        assert math.isclose(analysis.predict(fit, p.tokens, p.context), p.seconds, rel_tol=1e-6, abs_tol=1e-9)


def test_budget_advice_is_the_largest_budget_meeting_the_target():
    fit = analysis.CostFit("cpu/float32", a=0.02, b=0.001, c=0.00001, r2=1.0, n=10, terms=3)
    best = analysis.advise_budget(fit, 0.2, context=1000)
    assert best == 170                                   # 0.02 + 0.170 + 0.01 = 0.2
    assert analysis.predict(fit, best, 1000) <= 0.2 + 1e-12 < analysis.predict(fit, best + 1, 1000)
    assert analysis.advise_budget(fit, 0.02, context=1000) is None      # not even one token fits
    assert analysis.advise_budget(fit._replace(b=0.0), 0.2, 0) is None
    with pytest.raises(ValueError, match="positive"):
        analysis.advise_budget(fit, -1, 0)


# ---- stall causes ----
def cause(req, why, by=None, n=None):
    out = {"req": req, "cause": why}
    if by:
        out.update(by=by, by_tokens=n)
    return out


def test_each_gap_gets_the_causes_of_the_steps_in_it():
    s = [arrived("a", 0.0), arrived("b", 0.0), arrived("d", 0.3),
         step(0, 0.0, 0.1, [pre("a", 4, 0, 4), pre("b", 4, 0, 4)]),
         step(1, 0.1, 0.2, [dec("a", 4), dec("b", 4)]),
         # continuous: d's prompt runs alone, a and b wait for it
         step(2, 0.3, 0.9, [pre("d", 50, 0, 50)], stalled=["a", "b"],
              stall_causes=[cause("a", "prefill", "d", 50), cause("b", "prefill", "d", 50)]),
         # a slot short: b waits once more; a is preempted while this step is built
         step(3, 0.9, 1.0, [dec("d", 50)], stalled=["b"], stall_causes=[cause("b", "no_slot")], preempted=["a"]),
         step(4, 1.0, 1.1, [dec("b", 5), dec("d", 51), pre("a", 6, 0, 6)]),
         step(5, 1.1, 1.3, [dec("b", 6), dec("a", 6)], finished=["b"])]
    gaps = {(g.req, g.step): g for g in analysis.gap_causes(s)}
    assert set(gaps) == {("a", 4), ("b", 4)}
    b = gaps["b", 4]
    assert b.after == 1 and math.isclose(b.seconds, 0.9)
    assert [(p.step, p.cause, p.by, p.by_tokens) for p in b.parts] == [(2, "prefill", "d", 50),
                                                                       (3, "no_slot", None, None)]
    assert b.cause == "prefill"
    a = gaps["a", 4]          # the recompute chunk completes the prompt: its token ends the gap
    assert [(p.step, p.cause) for p in a.parts] == [(2, "prefill"), (3, "preempted")]
    times = analysis.cause_time(s)
    assert len(times) == 1 and math.isclose(times[0]["prefill"], 1.2) and math.isclose(times[0]["no_slot"], 0.1)
    assert math.isclose(times[0]["preempted"], 0.1) and times[0]["budget"] == 0.0


def test_a_stall_without_a_recorded_cause_is_unknown_and_one_step_gaps_are_not_gaps():
    s = [step(0, 0, 1, [pre("a", 3, 0, 3)]), step(1, 1, 2, [dec("a", 3)]), step(2, 2, 3, [], stalled=["a"]),
         step(3, 3, 4, [dec("a", 4)])]
    gaps = analysis.gap_causes(s)
    assert [(g.req, g.after, g.step, g.cause) for g in gaps] == [("a", 1, 3, "unknown")]


@pytest.mark.skipif(not WHY_TRACE.exists(), reason="run python -m tests.record_why_trace")
def test_recorded_trace_every_stall_has_its_recorded_cause_and_every_cause_appears():
    objs = trace.load(WHY_TRACE)
    recs = metrics.steps(objs)
    for r in recs:      # the engine wrote one cause per stalled request, in order
        assert [c["req"] for c in r["stall_causes"]] == list(r["stalled"])
        assert r["device"] == "cpu/float32"
    gaps = analysis.gap_causes(objs)
    causes = {p.cause for g in gaps for p in g.parts}
    assert {"prefill", "static_batch", "budget", "no_slot", "preempted"} <= causes and "unknown" not in causes
    # every metrics stall is a gap with a cause, and each gap's parts fit inside it
    stalls = {(req, tk.step) for req, tks in metrics.stalls(objs).items() for tk in tks}
    assert stalls <= {(g.req, g.step) for g in gaps}
    for g in gaps:
        assert sum(p.seconds for p in g.parts) <= g.seconds + 1e-9
        for p in g.parts:
            if p.cause in ("prefill", "static_batch"):     # the blamed request really ran that many tokens then
                rec = next(r for r in recs if r["step"] == p.step)
                assert any(it["req"] == p.by and it["tokens"] == p.by_tokens for it in rec["items"])
    fits = analysis.fit_stream(objs)
    assert [f.device for f in fits] == ["cpu/float32"] and fits[0].b > 0
    # a CPU: at the trace's budget of 64 tokens a step costs in proportion to its tokens
    assert analysis.regime(fits[0], 64) == "proportional"


# ---- the KV map: ops and maps rebuild the block manager exactly ----
class KVCase(Case):
    """A random scheduler workload (tests/test_scheduler_properties.py) whose block manager keeps its log;
    after every step the map rebuilt from the records must equal the block manager's blocks."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.sched.bm.log = []
        self.stream: list[dict] = []

    def check(self, batch, before, step):
        pass        # the scheduler's invariants are the other test's business

    def truth(self) -> dict:
        holders: dict[int, list[str]] = {}
        for s in self.seqs.values():
            for b in s.block_table:
                holders.setdefault(b, []).append(s.id)
        return {b.id: (tuple(sorted(holders.get(b.id, ()))), b.hash is not None) for b in self.sched.bm.blocks
                if b.id in holders or b.hash is not None}

    def apply(self, batch):
        super().apply(batch)
        i = len(self.stream)
        rec = {"type": "step", "step": i, "t_start": 0.0, "t_end": 0.0, "items": []}
        ops = kv_ops(self.sched.bm)
        if ops:
            rec["kv_ops"] = [op.to_dict() for op in ops]
        if i % KV_MAP_EVERY == 0:
            rec["kv_map"] = [e.to_dict() for e in kv_map(self.sched.bm, self.sched.running)]
        self.stream.append(rec)
        want = self.truth()
        assert analysis.kv_blocks(self.stream) == want, f"step {i}"
        if i >= KV_MAP_EVERY:     # a reader that joined late: exact from the first map it sees
            assert analysis.kv_blocks(self.stream[KV_MAP_EVERY * (i // KV_MAP_EVERY) - 3:]) == want, f"step {i}"


def test_kv_map_rebuilt_from_the_records_equals_the_block_manager_every_step():
    steps = 0
    for seed in range(300):
        case = KVCase(seed)
        case.drive()
        steps += len(case.stream)
    assert steps > 3000


def test_recorded_gpu_trace_fit_says_flat_and_cpu_trace_proportional_at_the_same_budgets():
    """The H200 trace (random weights at SmolLM2-135M's shapes; step time depends on shapes, not values):
    at its budgets a full budget's tokens cost less than a step's fixed part. The CPU trace: the opposite."""
    gpu_objs = trace.load(GPU_TRACE)
    meta = gpu_objs[0]
    assert meta["type"] == "trace" and meta["device"] == "cuda" and "random weights" in meta["model"]
    fits = analysis.fit_stream(gpu_objs)
    assert [f.device for f in fits] == ["cuda/bfloat16"] and fits[0].n == len(metrics.steps(gpu_objs))
    gpu, cpu = fits[0], analysis.fit_stream(trace.load(WHY_TRACE))[0]
    budget = meta["max_num_batched_tokens"]          # the budget most of its steps ran under (the page's caption)
    assert budget == 512 and sum(r["token_budget"] == budget for r in metrics.steps(gpu_objs)) > 0.5 * gpu.n
    for b in (16, 64, 256, budget):
        assert analysis.regime(gpu, b) == "flat", b
    for b in (64, 256, budget):
        assert analysis.regime(cpu, b) == "proportional", b
    # a GPU token costs a small fraction of a CPU token (per token, time relative to a step's fixed part)
    assert gpu.b / gpu.a < 0.1 * cpu.b / cpu.a
