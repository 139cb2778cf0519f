"""What the "why" data costs: time to build it per step, and bytes on the wire.

    python demos/bench/records.py [--chats 8] [--max-tokens 48] [--threads N]

Runs a chat workload with a long prompt arriving midway (decodes, prefill chunks,
stalls, prefix sharing) on the default model, then reports, over its steps:

  build time   timing.items + timing.record (item list, stall causes, the KV change
               list, the periodic KV map and the record itself) against the step's
               time: an upper bound on what the extra fields cost, since it also holds
               the items the record always had.
  map time     building the whole KV map (kv_map) measured apart, repeated, on the
               block tables of every 8th step while requests are running (the
               median over those steps and the largest).
  bytes        JSON bytes per step record with and without the new fields
               (stall_causes, kv_ops, kv_map, device).

Numbers, not tests: they depend on the machine and its load; say which CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.outputs.records import kv_map  # noqa: E402

NEW_FIELDS = ("stall_causes", "kv_ops", "kv_map", "device")


def time_kv_map(engine: LLMEngine, reps: int = 200) -> float:
    """Seconds to build the whole KV map from the engine's block tables as they are now."""
    t0 = time.perf_counter()
    for _ in range(reps):
        kv_map(engine.block_manager, engine.scheduler.running)
    return (time.perf_counter() - t0) / reps


def run(chats: int, max_tokens: int, threads: int | None) -> tuple[LLMEngine, list[dict], list[float]]:
    engine = LLMEngine(EngineConfig(device="cpu", policy="chunked", max_num_batched_tokens=64, max_num_seqs=16,
                                    cpu_threads=threads, seed=0))
    stream: list[dict] = []
    engine.subscribe(stream.append)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    system = "You are a friendly tutor. Answer in two sentences. "
    for i in range(chats):
        engine.add_request(prompt=system + f"Question {i}: what is {i} plus {i}?", params=params, label=f"user{i}")
    map_times: list[float] = []
    doc = system + " ".join(f"Paragraph {i} of the report says all is well." for i in range(40))
    for k in range(10 ** 6):
        if k == max_tokens // 3:
            engine.add_request(prompt=doc, params=SamplingParams(max_tokens=8, ignore_eos=True), label="Doc")
        if engine.step() is None:
            break
        if k % 8 == 0 and engine.scheduler.running:
            map_times.append(time_kv_map(engine))
    return engine, [r for r in stream if r.get("type") == "step"], map_times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    engine, steps, map_times = run(a.chats, a.max_tokens, a.threads)
    dur = [r["t_end"] - r["t_start"] for r in steps]
    build = [r["timing"]["items"] + r["timing"]["record"] for r in steps]
    ratio = [b / d for b, d in zip(build, dur)]
    full = [len(json.dumps(r)) for r in steps]
    lean = [len(json.dumps({k: v for k, v in r.items() if k not in NEW_FIELDS})) for r in steps]
    maps = [len(json.dumps(r["kv_map"])) for r in steps if "kv_map" in r]
    print(f"{len(steps)} steps, median step {statistics.median(dur) * 1000:.1f} ms")
    print(f"build time (items + record)  median {statistics.median(build) * 1e6:.0f} us = "
          f"{statistics.median(ratio) * 100:.3f} % of its step; total {sum(build) / sum(dur) * 100:.3f} % of step time")
    print(f"kv_map alone ({engine.block_manager.num_blocks} blocks, {len(map_times)} running states)  median "
          f"{statistics.median(map_times) * 1e6:.0f} us, largest {max(map_times) * 1e6:.0f} us; "
          f"sent every 32nd step")
    print(f"bytes per step record  median {statistics.median(lean)} without the new fields, "
          f"{statistics.median(full)} with ({statistics.median(full) / statistics.median(lean):.2f}x); "
          f"mean {sum(lean) / len(lean):.0f} -> {sum(full) / len(full):.0f}; a kv_map step adds "
          f"{max(maps, default=0)} bytes at most")


if __name__ == "__main__":
    main()
