"""Record tests/data/page_trace.json: a small real trace for the page-vs-Python metrics test.

    python -m tests.record_trace            # about half a minute on a laptop CPU

The default model plays the long-prompt scenario three times in one engine,
under chunked, continuous and static batching (three stretches of settings in
one stream), with a KV cache small enough that the document's prefill preempts
a reply: the trace then holds stalls (steps that left a running reply out) and
a preemption (whose wait is a gap, not a stall), the two things that used to be
counted differently by the page and the reports.
"""
from __future__ import annotations

from pathlib import Path

from app.readers import metrics
from app.replay.scenarios import get_scenario
from demos.compare import trace
from demos.compare.runner import engine_meta, run_scenario
from engine import EngineConfig, LLMEngine

OUT = Path(__file__).parent / "data" / "page_trace.json"
POLICIES = ("chunked", "continuous", "static")


def record(num_kv_blocks: int = 104) -> list[dict]:
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks, seed=0))
    scenario = get_scenario("long-prompt-interrupts", reply_tokens=24, doc_at=8, doc_tokens=4)
    stream: list[dict] = []
    for policy in POLICIES:
        engine.set_policy(policy, max_num_batched_tokens=128, max_num_seqs=4)
        stream += run_scenario(engine, scenario).stream
    return [engine_meta(engine, scenario)] + stream


def main():
    objs = record()
    trace.save(OUT, objs[1:], meta=objs[0])
    s = metrics.summarize(objs)
    print(f"wrote {OUT}: {s['num_steps']} steps, {s['stall_count']} stalls, {s['num_preemptions']} preemptions, "
          f"{len(metrics.stretches(objs))} stretches")


if __name__ == "__main__":
    main()
