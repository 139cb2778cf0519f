"""Record tests/data/why_trace.json: a real trace for the step-cost and stall-cause tests.

    python -m tests.record_why_trace        # under a minute on a laptop CPU

The default model plays one small scenario (four short chats, then a long
prompt) four times in one engine, so that every stall cause the scheduler
records appears: chunked, where the presenter lowers the budget to 3 tokens
under 4 running replies (budget) and then the sequence slots to 2 (no_slot);
continuous (prefill: the long prompt runs whole; the KV cache is small enough
that it then preempts a reply); chunked again, switched to static while the
long prompt is being chunked under the running replies (static_batch: static
batching prefills the rest of that prompt whole before anyone decodes; a batch
static batching forms itself is prefilled in one step, so stalls no member).
Steps carry `device` and `stall_causes`.
"""
from __future__ import annotations

from pathlib import Path

from app.readers import analysis
from app.replay.scenarios import Arrival, Scenario
from demos.compare import trace
from demos.compare.runner import engine_meta, run_scenario
from engine import EngineConfig, LLMEngine

OUT = Path(__file__).parent / "data" / "why_trace.json"
CHATS = ("Name three colours.", "Count from one to five.", "What is a cat?", "Say hello in French.")


def scenario(place: str) -> Scenario:
    doc = "Summarise this: " + " ".join(f"line {i} of the report says the {place} is fine." for i in range(9))
    return Scenario("why-trace", "four short chats, then a long prompt that crowds them out",
                    tuple(Arrival(0, name, 14, prompt=text)
                          for name, text in zip(("Alice", "Bob", "Carol", "Dan"), CHATS))
                    + (Arrival(3, "Doc", 12, prompt=doc),))


SCENARIO = scenario("lighthouse")
# one run of the scenario per entry: (policy, budget, max_num_seqs, max_prefill_chunk) at its start,
# and the settings the presenter switches to after that many steps of the run. The third run's long
# prompt is a new one (not prefix-cached) and its chunk cap keeps it under way when static takes over.
RUNS = ((SCENARIO, ("chunked", 64, 8, None), {6: ("chunked", 3, 8, None), 10: ("chunked", 64, 2, None)}),
        (SCENARIO, ("continuous", 64, 8, None), {}),
        (scenario("harbour"), ("chunked", 64, 8, 8), {5: ("static", 64, 8, None)}))


def record(num_kv_blocks: int = 13) -> list[dict]:
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks, block_size=16,
                                    seed=0, cpu_threads=1))
    stream: list[dict] = []
    for played, (policy, budget, seqs, cap), switches in RUNS:
        engine.set_policy(policy, max_num_batched_tokens=budget, max_num_seqs=seqs, max_prefill_chunk=cap)
        first = engine.step_index

        def switch(obj: dict, switches=switches, first=first):
            if obj.get("type") == "step" and obj["step"] - first + 1 in switches:
                policy, budget, seqs, cap = switches[obj["step"] - first + 1]
                engine.set_policy(policy, max_num_batched_tokens=budget, max_num_seqs=seqs, max_prefill_chunk=cap)
        stream += run_scenario(engine, played, on_record=switch).stream
    return [engine_meta(engine, SCENARIO)] + stream


def main():
    objs = record()
    trace.save(OUT, objs[1:], meta=objs[0])
    causes = sorted({p.cause for g in analysis.gap_causes(objs) for p in g.parts})
    print(f"wrote {OUT}: {sum(1 for o in objs if o.get('type') == 'step')} steps, causes {causes}")


if __name__ == "__main__":
    main()
