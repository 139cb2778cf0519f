"""How much the serving layer costs: the engine in-process vs behind the server, and with viewers.

    python demos/bench/server.py [--clients 16] [--max-tokens 64] [--repeats 3] [--viewers 10]

It starts `python -m app` on a free loopback port, then, in alternating order
so that drifting machine load hits both sides alike:

  1. streaming: --clients concurrent streaming /v1/chat/completions requests,
     fixed lengths (ignore_eos), output tokens/s measured by the clients, vs the
     same workload on an LLMEngine in this process (add all, step to the end).
  2. viewers: the same HTTP workload with --viewers step-stream websockets
     connected and reading, vs none. Engine output tokens/s comes from the step
     records of the run (tokens the steps produced / time from the first step's
     start to the last one's end), so client-side work does not blur it.

Medians of --repeats runs and their ratios are printed. Numbers, not tests:
they depend on the machine and on whatever else it is running.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process or of `pid`: unlike wall time, barely moved by other load."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(n: int) -> list[str]:
    return [f"Request {i}: tell me about the number {i * 7 + 3}." for i in range(n)]


# ---------------- in-process ----------------
def run_in_process(engine, n: int, max_tokens: int) -> tuple[float, float]:
    """(output tokens/s, CPU ms per output token)."""
    from engine import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    rids = [engine.add_request(messages=[{"role": "user", "content": p}], params=params) for p in prompts(n)]
    while engine.has_unfinished():
        engine.step()
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    tokens = sum(engine.get_request(r).num_output_tokens for r in rids)
    return tokens / elapsed, 1000 * cpu / tokens


# ---------------- through the server ----------------
async def one_stream(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def viewer(url: str, stop: asyncio.Event, counts: list[int]):
    async with websockets.connect(url, max_size=None, proxy=None) as ws:
        while not stop.is_set():
            try:
                await asyncio.wait_for(ws.recv(decode=False), timeout=0.2)   # a browser is elsewhere: read cheaply
                counts.append(1)
            except asyncio.TimeoutError:
                pass


def engine_rate(records: list[dict], first_step: int) -> float:
    """Output tokens per second of the engine over the steps of one run, from its records."""
    steps = [r for r in records if r["type"] == "step" and r["step"] >= first_step]
    tokens = sum(1 for s in steps for i in s["items"] if i["kind"] == "decode" or i.get("completes_prompt"))
    return tokens / (steps[-1]["t_end"] - steps[0]["t_start"])


async def run_http(base: str, pid: int, n: int, max_tokens: int, viewers: int) -> tuple[float, float, float, int]:
    """(client-side tokens/s, engine tokens/s from the records, server CPU ms per token, viewer messages)."""
    async with httpx.AsyncClient(base_url=base, timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=n + 4)) as http:
        stop, counts = asyncio.Event(), []
        watchers = [asyncio.ensure_future(viewer(base.replace("http", "ws") + "/ws/steps", stop, counts))
                    for _ in range(viewers)]
        await asyncio.sleep(0.5 if viewers else 0)          # let them connect and take their snapshot
        first_step = (await http.get("/api/engine")).json()["step"]
        t0, c0 = time.perf_counter(), cpu_seconds(pid)
        tokens = await asyncio.gather(*(one_stream(http, p, max_tokens) for p in prompts(n)))
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
        stop.set()
        await asyncio.gather(*watchers)
        last = (await http.get("/api/engine")).json()["step"]
        records = (await http.get("/api/trace", params={"last": last - first_step + 1})).json()["records"]
    return sum(tokens) / elapsed, engine_rate(records, first_step), 1000 * cpu / sum(tokens), len(counts)


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "app", "--port", "0", "--kv-cache-gb", str(args.kv_cache_gb),
           "--max-num-seqs", str(max(args.clients, 16)), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if m := re.search(r"at (http://127\.0\.0\.1:\d+)", line):
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--viewers", type=int, default=10)
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on both sides (1 is steadier on a busy shared machine)")
    args = p.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)     # the server inherits it
        import torch
        torch.set_num_threads(args.threads)

    from engine import EngineConfig, LLMEngine
    proc, base = start_server(args)
    try:
        engine = LLMEngine(EngineConfig(kv_cache_gb=args.kv_cache_gb, max_num_seqs=max(args.clients, 16)))
        print(f"server at {base}; {args.clients} clients x {args.max_tokens} tokens, {args.repeats} repeats, "
              f"device {engine.device}, dtype {engine.config.dtype}", flush=True)
        # warm-up on both sides: first passes are slow, and both should find the same prefixes cached
        run_in_process(engine, args.clients, 4)
        asyncio.run(run_http(base, proc.pid, args.clients, 4, 0))
        inproc, http_plain, http_viewers, eng_plain, eng_viewers = [], [], [], [], []
        cpu = {"in-process": [], "http": [], "http+viewers": []}    # CPU ms per output token
        runs = ["in-process", "http", "http+viewers"]
        for i in range(args.repeats):
            for kind in runs[i % 3:] + runs[:i % 3]:     # rotate the order: drifting load hits all alike
                if kind == "in-process":
                    rate, per_token = run_in_process(engine, args.clients, args.max_tokens)
                    inproc.append(rate)
                    cpu[kind].append(per_token)
                    continue
                v = args.viewers if kind == "http+viewers" else 0
                client_rate, engine_tokens, per_token, got = asyncio.run(
                    run_http(base, proc.pid, args.clients, args.max_tokens, v))
                cpu[kind].append(per_token)
                (http_viewers if v else http_plain).append(client_rate)
                (eng_viewers if v else eng_plain).append(engine_tokens)
                if v:
                    assert got > 0, "the viewers received nothing"
            print(f"  run {i + 1}: in-process {inproc[-1]:.1f} tok/s | HTTP {http_plain[-1]:.1f} tok/s "
                  f"(engine {eng_plain[-1]:.1f}) | HTTP + {args.viewers} viewers {http_viewers[-1]:.1f} tok/s "
                  f"(engine {eng_viewers[-1]:.1f})", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    med = statistics.median

    def ratios(a: list[float], b: list[float]) -> str:
        paired = med([x / y for x, y in zip(a, b)])      # each run against its neighbour in time
        return f"ratio of medians {med(a) / med(b):.3f}, median of paired ratios {paired:.3f}"
    print(f"\nmedians over {args.repeats} runs (output tokens/s)")
    print(f"  in-process engine                {med(inproc):8.1f}")
    print(f"  /v1 streaming, {args.clients} clients        {med(http_plain):8.1f}   "
          f"{ratios(http_plain, inproc)}  (target >= 0.90)")
    print(f"  engine behind the server         {med(eng_plain):8.1f}")
    print(f"  same, {args.viewers} step-stream viewers   {med(eng_viewers):8.1f}   "
          f"{ratios(eng_viewers, eng_plain)}  (target >= 0.97)")
    c = {k: med(v) for k, v in cpu.items()}
    print("CPU ms per output token (steadier than wall time on a busy machine; ratio = tokens/s per CPU second)")
    print(f"  in-process {c['in-process']:.2f} | server {c['http']:.2f} (ratio {c['in-process'] / c['http']:.3f}) | "
          f"server with {args.viewers} viewers {c['http+viewers']:.2f} (ratio {c['http'] / c['http+viewers']:.3f})")

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
