"""The budget lesson on the real engine: a budget of 16 tokens filled three ways, each shape in some step."""
from app.scenarios import get_scenario
from demos.runner import run_scenario
from engine import EngineConfig, LLMEngine, metrics


def shape(rec: dict) -> tuple[int, tuple[int, ...]]:
    """(decodes, sizes of the prefill chunks) of a step."""
    return (sum(1 for i in rec["items"] if i["kind"] == "decode"),
            tuple(i["tokens"] for i in rec["items"] if i["kind"] == "prefill"))


def test_budget_16_runs_as_16_decodes_then_8_decodes_and_2_chunks_then_4_prefills():
    sc = get_scenario("budget-shapes", reply_tokens=6)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", seed=0, **sc.engine))
    recs = metrics.steps(run_scenario(engine, sc).stream)
    shapes = [shape(r) for r in recs]
    assert all(r["num_tokens"] <= 16 for r in recs)
    assert (8, (4, 4)) in shapes                         # 8 decodes + 2 chunks of 4
    assert (16, ()) in shapes                            # 16 decodes
    assert (0, (4, 4, 4, 4)) in shapes                   # 4 prefills of 4 tokens
    order = [shapes.index(x) for x in ((8, (4, 4)), (16, ()), (0, (4, 4, 4, 4)))]
    assert order == sorted(order), shapes
