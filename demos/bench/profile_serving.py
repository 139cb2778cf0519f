"""Where a serving step's time goes under many concurrent streams, on the real server code path.

    python demos/bench/profile_serving.py [--clients 32] [--prompt-tokens 256] [--max-tokens 32] [--serving]

It serves the default model in this process (EngineService + the FastAPI app + uvicorn on a loopback
port, rate limit off), sends --clients streaming /v1/completions requests at once (fixed lengths,
ignore_eos), and splits the engine thread's wall time by phase:

  schedule, read items, record    from the step records' own `timing`
  forward: linears, attention,    timers around the model's Linear modules, the attention backend, the
    rest of the model, sampling   sampler and the detokenizer (wrapped here, for this run only)
  detokenise, the other updates
  between steps                   the engine thread outside step(): handing text to the event loop,
                                  viewers' records, commands

and, on the event loop, the lag of a 10 ms heartbeat (how late the loop answers while it streams).
To time the pieces, a decode step's layers are called one by one here: where a served step runs them in
one call (models.llama.LlamaForCausalLM.fused_decode: bf16 on an AMX CPU, fp32 on AVX-512), its decode
steps are faster than this run's by the Python between the pieces (docs/results.md, "AMX tiles").
Numbers depend on the machine and on its load: read the shares, not the seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

SERVING = dict(max_num_seqs=64, max_num_batched_tokens=2048)   # = python -m app --serving


class Timers:
    """Seconds spent inside wrapped callables, per name; only the outermost call of a name counts."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)

    def wrap(self, obj, attr: str, name: str):
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            with self.section(name):
                return fn(*a, **kw)
        setattr(obj, attr, timed)

    @contextmanager
    def section(self, name: str):
        self.depth[name] += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.depth[name] -= 1
            if not self.depth[name]:
                self.total[name] += time.perf_counter() - t0


def instrument(engine, timers: Timers) -> bool:
    """Timers around the pieces; returns whether the model would have run a decode step's layers in one call."""
    import engine.execution.model_runner as runner_module
    engine = getattr(engine, "single", engine)          # the service's EngineSwitch: its one engine
    model = engine.runner.model
    fused, model.fused_decode = model.fused_decode, False   # layers one by one, so each piece can be timed
    for layer in model.layers:                          # the linears, whatever their weight format
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            timers.wrap(module, "forward", "linears")
        timers.wrap(layer.self_attn, "backend", "attention")
    timers.wrap(model, "forward", "model")
    timers.wrap(model, "compute_logits", "lm_head")
    runner_module.sample = _timed(timers, "sampling", runner_module.sample)
    timers.wrap(engine.detokenizer, "update", "detokenise")
    timers.wrap(engine.runner, "run", "runner")
    return fused


def _timed(timers: Timers, name: str, fn):
    def timed(*a, **kw):
        with timers.section(name):
            return fn(*a, **kw)
    return timed


async def stream(http, prompt_ids: list[int], max_tokens: int) -> int:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


async def heartbeat(stop: asyncio.Event, lags: list[float]):
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append(time.perf_counter() - t0 - 0.01)


async def drive(url: str, n: int, prompt_tokens: int, max_tokens: int) -> tuple[float, int, list[float]]:
    import httpx
    prompts = [[(1000 + 37 * i + j) % 40000 + 100 for j in range(prompt_tokens)] for i in range(n)]
    stop, lags = asyncio.Event(), []
    beat = asyncio.ensure_future(heartbeat(stop, lags))
    async with httpx.AsyncClient(base_url=url, timeout=3600, trust_env=False,
                                 limits=httpx.Limits(max_connections=n + 4)) as http:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(stream(http, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - t0
    stop.set()
    await beat
    return elapsed, sum(tokens), lags


def serve(args):
    import uvicorn

    from app import EngineService, ServerConfig, create_app
    from engine import EngineConfig
    engine_kw = dict(SERVING) if args.serving else {}
    service = EngineService(EngineConfig(kv_cache_gb=1.0, cpu_threads=args.threads, **engine_kw),
                            ServerConfig(rate_limit_per_minute=0, max_tokens_cap=4096))
    service.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service, manage_service=False), log_level="warning",
                                           proxy_headers=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return service, server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    p.add_argument("--serving", action="store_true", help="the serving preset (max_num_seqs 64, budget 2048)")
    args = p.parse_args()
    service, server, url = serve(args)
    timers = Timers()
    records: list[dict] = []
    args.fused = asyncio.run(service_call(service, lambda: instrument(service.engine, timers)))
    service.engine.subscribe(lambda r: records.append(r) if r.get("type") == "step" else None)
    elapsed, tokens, lags = asyncio.run(drive(url, args.clients, args.prompt_tokens, args.max_tokens))
    server.should_exit = True
    service.stop()
    report(records, timers, elapsed, tokens, lags, args)


async def service_call(service, fn):
    return await service.call(fn)


def report(records: list[dict], timers: Timers, elapsed: float, tokens: int, lags: list[float], args):
    steps = [r for r in records if r["items"]]
    busy = steps[-1]["t_end"] - steps[0]["t_start"]
    inside = sum(r["t_end"] - r["t_start"] for r in steps)
    timing = {k: sum(r["timing"][k] for r in steps) for k in ("schedule", "items", "forward", "record")}
    t = timers.total
    rows = [
        ("schedule", timing["schedule"]), ("read items", timing["items"]),
        ("linears (30 layers x 4)", t["linears"] - 0), ("attention", t["attention"]),
        ("rest of the model (norms, RoPE, MLP act, embed)", t["model"] - t["linears"] - t["attention"]),
        ("lm_head", t["lm_head"]), ("sampling", t["sampling"]),
        ("runner: inputs, copies", t["runner"] - t["model"] - t["lm_head"] - t["sampling"]),
        ("detokenise", t["detokenise"]),
        ("other updates (scheduler, events, stops)", timing["forward"] - t["runner"] - t["detokenise"]),
        ("record", timing["record"]),
        ("between steps (deltas to the event loop, viewers, commands)", busy - inside - timing["record"]),
    ]
    print(f"{args.clients} streams, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each"
          f"{' (serving preset)' if args.serving else ''}: {tokens} tokens in {elapsed:.1f} s = "
          f"{tokens / elapsed:.1f} out tok/s, {len(steps)} steps, {busy / len(steps) * 1000:.0f} ms a step"
          f"{' (layers called one by one, to time them)' if args.fused else ''}")
    for name, seconds in rows:
        print(f"  {name:<62} {100 * seconds / busy:5.1f} %  {1000 * seconds / len(steps):7.1f} ms/step")
    decode_steps = [r for r in steps if all(i["kind"] == "decode" for i in r["items"])]
    if decode_steps:
        print(f"  decode-only steps: {len(decode_steps)}, "
              f"median {statistics.median(r['t_end'] - r['t_start'] for r in decode_steps) * 1000:.0f} ms"
              f" at median {statistics.median(len(r['items']) for r in decode_steps):.0f} sequences")
    if lags:
        q = statistics.quantiles(lags, n=100)
        print(f"  event loop: 10 ms heartbeat late by p50 {q[49] * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
