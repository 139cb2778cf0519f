"""Record tests/data/spec_trace.json: a real speculative-decoding trace for the page-vs-Python tests.

    python -m tests.record_spec_trace       # about ten seconds on a laptop CPU

The default model plays the speculative lesson's scenario (one user alone, then the room) twice in one
engine under chunked batching: without speculation, then with the lesson's n-gram drafts. Two stretches
of settings; the second's decodes verify drafts, some kept, some rejected.
"""
from __future__ import annotations

from pathlib import Path

from app.readers import metrics
from app.replay.scenarios import LESSON_SPECULATION, get_scenario
from demos.compare import trace
from demos.compare.runner import engine_meta, run_scenario
from engine import EngineConfig, LLMEngine

OUT = Path(__file__).parent / "data" / "spec_trace.json"


def record() -> list[dict]:
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", seed=0, cpu_threads=1))
    scenario = get_scenario("speculative-room", reply_tokens=32, room=7, room_at=16, room_tokens=16)
    stream: list[dict] = []
    for spec in (None, LESSON_SPECULATION):
        engine.set_policy("chunked", max_num_batched_tokens=256, max_num_seqs=16, speculative_config=spec)
        stream += run_scenario(engine, scenario).stream
    return [engine_meta(engine, scenario)] + stream


def main():
    objs = record()
    trace.save(OUT, objs[1:], meta=objs[0])
    s = metrics.summarize(objs)
    print(f"wrote {OUT}: {s['num_steps']} steps, {s['draft_tokens']} drafted, {s['accepted_tokens']} accepted, "
          f"{len(metrics.stretches(objs))} stretches")


if __name__ == "__main__":
    main()
