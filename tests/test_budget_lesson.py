"""The budget lesson on the real engine: a budget of 16 tokens filled three ways, each shape in some step."""
from app.readers import metrics
from app.replay.scenarios import get_scenario
from demos.compare.runner import run_scenario
from engine import EngineConfig, LLMEngine


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


def test_the_budget_example_is_a_numbered_lesson_with_its_caption_in_both_languages():
    from app.ui.page import LESSONS
    from app.ui.text import TEXT
    k = [x.scenario for x in LESSONS].index("budget-shapes") + 1
    sc = get_scenario("budget-shapes")
    assert sc.engine["max_num_batched_tokens"] == 16 and sc.engine["max_prefill_chunk"] == 4
    for lang in ("en", "zh"):
        caption, button = TEXT[lang][f"step{k}"], TEXT[lang][f"step{k}_btn"]
        assert caption.startswith(f"**{k} · ") and button.startswith(f"▶ {k} · ")
        for shape in ("8 + 2 × 4", "16 × 1", "4 × 4"):     # the three shapes the test above finds, in its order
            assert shape in caption, (lang, shape)
        assert caption.index("8 + 2 × 4") < caption.index("16 × 1") < caption.index("4 × 4")
    assert all(x.text_key(i) in TEXT["en"] and x.text_key(i) + "_btn" in TEXT["zh"] for i, x in enumerate(LESSONS, 1))
