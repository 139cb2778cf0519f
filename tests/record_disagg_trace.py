"""Record tests/data/disagg_trace.json: a small real trace of the disaggregated setting, for the
page-vs-Python metrics test (the KV-transfer line) and the two-lane chart.

    python -m tests.record_disagg_trace          # a minute or two on a 2-core CPU (two worker processes)

The default model plays the long-prompt scenario twice on one DisaggregatedEngine, first under a
token budget of 128, then of 64 (two stretches of settings in one stream, on one clock), so the
trace holds prefill steps on the prefill worker, decode steps on the decode worker running at the
same time, and one KV hand-over per request.
"""
from __future__ import annotations

from pathlib import Path

from app.readers import metrics
from app.replay.scenarios import get_scenario
from demos.compare import trace
from demos.compare.runner import engine_meta, run_scenario
from engine import EngineConfig
from engine.disagg.router import DisaggregatedEngine

OUT = Path(__file__).parent / "data" / "disagg_trace.json"
BUDGETS = (128, 64)


def record() -> list[dict]:
    scenario = get_scenario("long-prompt-interrupts", reply_tokens=24, doc_at=8, doc_tokens=4)
    with DisaggregatedEngine(EngineConfig(device="cpu", dtype="float32", kv_cache_gb=0.25, max_model_len=2048,
                                          seed=0)) as engine:
        stream: list[dict] = []
        for budget in BUDGETS:
            engine.set_policy(max_num_batched_tokens=budget, max_num_seqs=4)
            stream += run_scenario(engine, scenario).stream
        return [engine_meta(engine, scenario)] + stream


def main():
    objs = record()
    trace.save(OUT, objs[1:], meta=objs[0])
    s = metrics.summarize(objs)
    print(f"wrote {OUT}: {s['num_steps']} steps, {s['kv_transfers']} KV transfers "
          f"(p50 {s['kv_transfer_p50_s'] * 1e3:.1f} ms), {len(metrics.stretches(objs))} stretches")


if __name__ == "__main__":
    main()
