"""Record tests/data/why_trace.json: a real trace for the step-cost and stall-cause tests.

    python -m tests.record_why_trace        # under a minute on a laptop CPU

The default model plays one small scenario (four short chats, then a long
prompt) four times in one engine, so that every stall cause the scheduler
records appears: chunked, where the presenter lowers the budget to 3 tokens
under 4 running replies (budget) and then the sequence slots to 2 (no_slot);
continuous (prefill: the long prompt runs whole; the KV cache is small enough
that it then preempts a reply); static with a budget smaller than the batch's
prompts (static_batch). Steps carry `device` and `stall_causes`.
"""
from __future__ import annotations

from pathlib import Path

from app.scenarios import Arrival, Scenario
from demos import trace
from demos.runner import engine_meta, run_scenario
from engine import EngineConfig, LLMEngine, analysis

OUT = Path(__file__).parent / "data" / "why_trace.json"
SETTINGS = (("chunked", 64, 8), ("continuous", 64, 8), ("static", 8, 4))
# chunked run: (steps into the run, budget, max_num_seqs) the presenter switches to
SWITCHES = {6: (3, 8), 10: (64, 2)}
CHATS = ("Name three colours.", "Count from one to five.", "What is a cat?", "Say hello in French.")
DOC = "Summarise this: " + " ".join(f"line {i} of the report says the lighthouse is fine." for i in range(9))
SCENARIO = Scenario("why-trace", "four short chats, then a long prompt that crowds them out",
                    tuple(Arrival(0, name, 14, prompt=text) for name, text in zip(("Alice", "Bob", "Carol", "Dan"), CHATS))
                    + (Arrival(3, "Doc", 12, prompt=DOC),))


def record(num_kv_blocks: int = 13) -> list[dict]:
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks, block_size=16,
                                    seed=0, cpu_threads=1))
    scenario = SCENARIO
    stream: list[dict] = []
    for policy, budget, seqs in SETTINGS:
        engine.set_policy(policy, max_num_batched_tokens=budget, max_num_seqs=seqs)
        first = engine.step_index

        def switch(obj: dict):
            if policy == "chunked" and obj.get("type") == "step" and obj["step"] - first + 1 in SWITCHES:
                budget, seqs = SWITCHES[obj["step"] - first + 1]
                engine.set_policy(max_num_batched_tokens=budget, max_num_seqs=seqs)
        stream += run_scenario(engine, scenario, on_record=switch).stream
    return [engine_meta(engine, scenario)] + stream


def main():
    objs = record()
    trace.save(OUT, objs[1:], meta=objs[0])
    causes = sorted({p.cause for g in analysis.gap_causes(objs) for p in g.parts})
    print(f"wrote {OUT}: {sum(1 for o in objs if o.get('type') == 'step')} steps, causes {causes}")


if __name__ == "__main__":
    main()
