"""Soak test: many concurrent clients against a real server on loopback. Nothing lost, nothing leaked.

    python -m demos.load.soak                       # the long form: 500 requests, 32 clients
    python -m demos.load.soak --requests 60 --clients 8 --json soak.json

It starts `python -m app` on a free 127.0.0.1 port with a KV cache small
enough to force preemption, computes greedy reference replies in-process,
then sends bounded traffic with the official openai client: streaming and
non-streaming chats, some sampled, a share of clients hanging up mid-stream,
while the presenter flips policy and budgets every couple of seconds. It
passes when no request got a 5xx, every completed greedy reply equals its
reference, no KV block is left in use, and resident memory stayed flat.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the moon.",
    "What does a CPU do?",
    "Give me a synonym for happy.",
    "Why do cats purr? Answer briefly.",
    "Count from one to five.",
    "Summarise the plot of Cinderella in one sentence. " + "Keep it short. " * 15,
]
KEY = "soak-presenter-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def references(max_tokens: int, model: str | None = None) -> dict[str, str]:
    """Greedy replies computed in-process: what every batch must reproduce. fp32 on both sides: a bf16
    matmul's rounding depends on the batch's shape (the default dtype on CPUs with AMX), fp32's only
    below what changes a greedy choice."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    eng = LLMEngine(EngineConfig(model=model, kv_cache_gb=0.25, dtype="float32"))
    outs = eng.generate(messages=[[{"role": "user", "content": p}] for p in PROMPTS],
                        params=SamplingParams(max_tokens=max_tokens))
    return {p: o["text"] for p, o in zip(PROMPTS, outs)}


def start_server(port: int, kv_cache_gb: float, block_size: int, model: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PRESENTER_KEY": KEY}
    cmd = [sys.executable, "-m", "app", "--port", str(port), "--kv-cache-gb", str(kv_cache_gb),
           *(["--model", model] if model else []),
           "--block-size", str(block_size), "--dtype", "float32",
           "--max-waiting", "1000", "--max-num-seqs", "16", "--log-level", "warning"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def wait_healthy(http, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await http.get("/healthz")).status_code == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("server did not become healthy")


async def one_request(client, rng: random.Random, stats: dict, refs: dict, max_tokens: int, disconnect: float):
    import openai
    prompt = rng.choice(PROMPTS)
    sampled = rng.random() < 0.2
    hang_up = rng.random() < disconnect
    stream = hang_up or rng.random() < 0.7
    kw = dict(model=stats["model"], messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
              temperature=0.8 if sampled else 0.0, seed=rng.randrange(1000) if sampled else None)
    try:
        if stream:
            chunks, text, finish = 0, "", None
            s = await client.chat.completions.create(stream=True, **kw)
            async for chunk in s:
                chunks += 1
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if hang_up and chunks >= 2:
                    await s.close()                   # the client goes away mid-reply
                    stats["disconnected"] += 1
                    return
        else:
            r = await client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        stats["completed"] += 1
        if not sampled:
            stats["greedy_checked"] += 1
            if text != refs[prompt]:
                stats["mismatches"].append({"prompt": prompt[:40], "got": text[:80], "want": refs[prompt][:80]})
    except openai.APIStatusError as e:
        key = "5xx" if e.status_code >= 500 else f"{e.status_code}"
        stats["status"][key] = stats["status"].get(key, 0) + 1
    except Exception as e:                            # connection errors count as failures too
        stats["errors"].append(f"{type(e).__name__}: {e}"[:200])


async def flip_policies(http, stop: asyncio.Event, rng: random.Random, stats: dict, every: float):
    while not stop.is_set():
        body = {"policy": rng.choice(["static", "continuous", "chunked"]),
                "max_num_batched_tokens": rng.choice([16, 64, 256]), "max_num_seqs": rng.choice([4, 8, 16])}
        r = await http.post("/api/engine", json=body, headers={"X-Presenter-Key": KEY})
        stats["policy_switches"] += r.status_code == 200
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def preemption_burst(http, client, model: str, refs: dict, max_tokens: int, size: int = 8) -> dict:
    """A fixed workload that must preempt: `size` copies of one short prompt admitted in one step.

    The presenter slows the engine down (step_delay) so that every copy is queued before the next
    step, then lets it run at full speed. Admission asks for room for a whole prompt, but identical
    prompts share their full blocks, so more copies are admitted than the cache can grow: each
    reply needs a new block within its first block_size tokens, and the cache has too few for all.
    (With 0.006 GB: 8 blocks of 16 tokens; 37-token prompts; 4 copies admitted, 2 blocks left.)
    """
    short = [p for p in PROMPTS if len(p) < 60]
    prompt = max(short, key=lambda p: len(refs[p]))     # the longest reply: it surely needs a new block
    headers = {"X-Presenter-Key": KEY}
    before = (await http.get("/api/engine")).json()["preemptions"]
    await http.post("/api/engine", json={"policy": "chunked", "max_num_batched_tokens": 256, "max_num_seqs": 16,
                                         "step_delay": 2.0}, headers=headers)
    calls = [asyncio.create_task(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0))
        for _ in range(size)]
    for _ in range(200):                          # all queued (or already running) before the next step
        if (await http.get("/api/engine")).json()["live_requests"] >= size:
            break
        await asyncio.sleep(0.05)
    await http.post("/api/engine", json={"step_delay": 0.0}, headers=headers)
    replies = await asyncio.gather(*calls)
    after = (await http.get("/api/engine")).json()["preemptions"]
    wrong = sum(r.choices[0].message.content != refs[prompt] for r in replies)
    return {"burst_requests": size, "burst_preemptions": after - before, "burst_mismatches": wrong}


async def soak(args) -> dict:
    import httpx
    import openai
    refs = references(args.max_tokens, args.model)
    port = free_port()
    proc = start_server(port, args.kv_cache_gb, args.block_size, args.model)
    url = f"http://127.0.0.1:{port}"
    stats = dict(requests=args.requests, clients=args.clients, completed=0, disconnected=0, greedy_checked=0,
                 policy_switches=0, mismatches=[], errors=[], status={})
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            await wait_healthy(http)
            stats["model"] = (await http.get("/v1/models")).json()["data"][0]["id"]
            def client_for(i: int):
                # each worker stands for one student's laptop: its own address for the per-client
                # rate limit (a documentation-range address, carried only in the proxy header)
                return openai.AsyncOpenAI(base_url=url + "/v1", api_key="soak", max_retries=0,
                                          default_headers={"X-Forwarded-For": f"198.51.100.{i % 250 + 1}"},
                                          http_client=httpx.AsyncClient(trust_env=False, timeout=300))

            client = client_for(args.clients)
            rng = random.Random(args.seed)
            await one_request(client, rng, dict(stats, mismatches=[], errors=[], status={}), refs, 4, 0)  # warm-up
            stats.update(await preemption_burst(http, client, stats["model"], refs, args.max_tokens))
            stats["rss_start_mb"] = rss_mb(proc.pid)
            stop, t0 = asyncio.Event(), time.monotonic()
            flipper = asyncio.create_task(flip_policies(http, stop, random.Random(args.seed + 1), stats,
                                                        args.flip_every))
            queue = list(range(args.requests))

            async def worker(i: int):
                wrng, mine = random.Random(args.seed * 1000 + i), client_for(i)
                while queue and time.monotonic() - t0 < args.max_seconds:
                    queue.pop()
                    await one_request(mine, wrng, stats, refs, args.max_tokens, args.disconnect)

            await asyncio.gather(*(worker(i) for i in range(args.clients)))
            stop.set()
            await flipper
            stats["seconds"] = round(time.monotonic() - t0, 1)
            # every request has ended: nothing may still hold KV blocks
            state = {}
            for _ in range(60):
                state = (await http.get("/api/engine")).json()
                if state["live_requests"] == 0 and state["kv"]["used"] == 0:
                    break
                await asyncio.sleep(0.5)
            stats["blocks_leaked"] = state["kv"]["used"]
            stats["live_requests_left"] = state["live_requests"]
            stats["preemptions"] = state.get("preemptions")
            stats["aborted_by_engine"] = state.get("requests_aborted")
            stats["rss_end_mb"] = rss_mb(proc.pid)
            stats["healthy_after"] = (await http.get("/healthz")).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    stats["not_sent"] = args.requests - (stats["completed"] + stats["disconnected"] + sum(stats["status"].values())
                                         + len(stats["errors"]))
    return stats


def verdict(stats: dict) -> list[str]:
    problems = []
    served = stats["completed"] + stats["disconnected"]
    if served < 0.9 * stats["requests"]:
        problems.append(f"only {served} of {stats['requests']} requests were served (statuses {stats['status']})")
    if stats["status"].get("5xx"):
        problems.append(f"{stats['status']['5xx']} responses were 5xx")
    if stats["errors"]:
        problems.append(f"{len(stats['errors'])} client errors, e.g. {stats['errors'][0]}")
    if stats["mismatches"]:
        problems.append(f"{len(stats['mismatches'])} greedy replies differ from the reference")
    if stats["blocks_leaked"] or stats["live_requests_left"]:
        problems.append(f"{stats['blocks_leaked']} KV blocks / {stats['live_requests_left']} requests left")
    if not stats["burst_preemptions"]:
        problems.append("the burst did not preempt: the KV cache was meant to be small enough to force it")
    if stats["burst_mismatches"]:
        problems.append(f"{stats['burst_mismatches']} greedy replies of the burst differ from the reference")
    if not stats["preemptions"] and stats["require_preemption"]:
        problems.append("no preemption happened: the KV cache was meant to be small enough to force it")
    if not stats["healthy_after"]:
        problems.append("server unhealthy afterwards")
    if stats["rss_end_mb"] > stats["rss_start_mb"] * 1.25 + 150:
        problems.append(f"RSS grew from {stats['rss_start_mb']:.0f} to {stats['rss_end_mb']:.0f} MB")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--model", default=None, help="a model folder (default: the default model); the KV cache's "
                                                  "size in GB is the model's: scale --kv-cache-gb with it")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.3, help="share of clients that hang up mid-stream")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-gb", type=float, default=0.008, help="small, to force preemption")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (smaller: more preemption)")
    p.add_argument("--flip-every", type=float, default=2.0, help="seconds between policy switches")
    p.add_argument("--max-seconds", type=float, default=1800, help="stop sending after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-no-preemption", action="store_true",
                   help="pass even if no preemption happened (short runs share prompts through the prefix cache)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    stats = asyncio.run(soak(args))
    stats["require_preemption"] = not args.allow_no_preemption
    problems = verdict(stats)
    stats["problems"] = problems
    print(json.dumps({k: v for k, v in stats.items() if k not in ("mismatches", "errors")}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=2)
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
