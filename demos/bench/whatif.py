"""What a live request sees while a what-if replay runs (app/replay/whatif.py), beside what it sees alone.

    python -m demos.bench.whatif [--tokens 32] [--repeats 3] [--threads N]

In-process: an EngineService (no HTTP) plays a small session into its arrival
log, then times one live request of --tokens tokens alone, and the same request
while a what-if replay of that session (four requests; one setting: chunked, budget 32) runs
beside it; repeated and interleaved. Prints the live request's TBT p50/p99 and
its total time both ways, with the ratio, and the CPU it ran on.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from app.config import ServerConfig
from app.readers import metrics
from app.replay.scenarios import static_vs_continuous
from app.replay.whatif import WhatIfJob, to_scenario
from app.serving.service import EngineService
from demos.compare.scenario import machine
from engine import EngineConfig, SamplingParams


async def one_live(service: EngineService, tokens: int) -> dict:
    """One greedy request of exactly `tokens` tokens; its TBTs from the records it produced."""
    stream = await service.submit(prompt="Tell me about lighthouses.", label="live",
                                  params=SamplingParams(max_tokens=tokens, ignore_eos=True))
    t0 = time.perf_counter()
    async with stream:
        async for _ in stream:
            pass
    wall = time.perf_counter() - t0
    _, recs = service.ring.last_steps(service.config.history)
    gaps = metrics.tbts(recs).get(stream.id, [])
    return {"tbt_p50_s": metrics.percentile(gaps, 50), "tbt_p99_s": metrics.percentile(gaps, 99), "wall_s": wall}


async def main_async(args) -> None:
    service = EngineService(EngineConfig(kv_cache_gb=0.25, cpu_threads=args.threads),
                            ServerConfig(history=8192))
    await asyncio.to_thread(service.start)
    try:
        sc = static_vs_continuous(reply_tokens=(8, 24, 12, 16))
        async def ask(a):
            s = await service.submit(**a.request_kwargs(), params=a.params(), label=a.label)
            async with s:
                async for _ in s:
                    pass
        await asyncio.gather(*(ask(a) for a in sc.arrivals))   # the session the replay will replay
        logged, records, _ = service.arrival_log.window()
        alone, beside, replay_s = [], [], []
        for _ in range(args.repeats):
            alone.append(await one_live(service, args.tokens))
            job = WhatIfJob(to_scenario(logged), records, [{"policy": "chunked", "max_num_batched_tokens": 32}],
                            service.engine_config, service.describe())
            t0 = time.perf_counter()
            service.whatif = job
            service._wake.set()
            while job.loading:                              # measure while it steps, not while it loads
                await asyncio.sleep(0.05)
            beside.append(await one_live(service, args.tokens))
            while not job.done.is_set():
                await asyncio.sleep(0.05)
            replay_s.append(time.perf_counter() - t0)
    finally:
        await asyncio.to_thread(service.stop)
    m = machine()
    print(f"CPU: {m['cpu']}, {m['cpu_count']} cores, torch threads {m['torch_threads']}; "
          f"live request of {args.tokens} tokens, medians of {args.repeats}")
    print(f"{'':22}{'alone':>12}{'beside replay':>16}{'ratio':>8}")
    for k in ("tbt_p50_s", "tbt_p99_s", "wall_s"):
        a, b = statistics.median(x[k] for x in alone), statistics.median(x[k] for x in beside)
        print(f"{k:22}{a * 1e3:>10.0f}ms{b * 1e3:>14.0f}ms{b / a:>8.2f}")
    print(f"replay of {len(logged)} requests (load + warm-up + replay): median {statistics.median(replay_s):.1f} s")


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.bench.whatif", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
