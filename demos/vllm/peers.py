"""batchscope beside vLLM on the same CPU, the same model folder and the same workload, one measured at a time.

    python demos/vllm/peers.py [--concurrency 1,8,32] [--prompt-tokens 256] [--output-tokens 64]
                                [--vllm-python PATH/TO/VENV/bin/python] [--baseline PATH/TO/CHECKOUT]

Both servers are started on free loopback ports with the same prepared model folder (a standard
Hugging Face folder) and stay up; then, for --rounds rounds, they take turns at each concurrency level
(one measured at a time, the other idle; the order of the turns rotates from one level to the next, so
no server always follows the same one), so a change in the machine's load hits both, and the medians
and the per-round ratios are printed: batchscope with its serving preset (`python -m app --serving`), vLLM
(`python -m vllm.entrypoints.openai.api_server`, both cores) where --vllm-python (or $VLLM_PYTHON)
is a Python that imports vllm (one that is not there, or cannot import it, is refused by name;
without either, its row says "not installed"); and, with --baseline, batchscope from another checkout
of this project (a worktree of an earlier commit: before and after a change, in the same run, with the
same flags). Both compute in the same
precision: --dtype (auto: bfloat16 on a CPU with AMX, else float32, as batchscope picks) goes to both;
int8 (batchscope's int8 linears) has no vLLM-CPU counterpart, so vLLM then runs float32. Each row
names its dtype. For each concurrency level the
same client (this script, an asyncio streaming client) keeps that many /v1/completions streams busy
with fixed-length requests (distinct token-id prompts, ignore_eos) and measures, per server:

  output tokens/s   all completion tokens / wall time of the level
  TTFT p50 / p99    first streamed text - request sent
  ITL p50 / p99     gaps between a request's streamed text chunks (a chunk may carry several tokens:
                    each gap is divided by the tokens it brought, from continuous usage stats)

Percentiles are app.readers.metrics.percentile. A shared or busy machine moves every number: the load average
is printed before and after, and only ratios within one run mean much.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from app.readers.metrics import percentile  # noqa: E402

NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dtypes(given: str) -> tuple[str, str]:
    """(batchscope's --dtype, vLLM's --dtype) for --dtype: auto resolved as the engine resolves it on this CPU."""
    from engine.config import DTYPES, EngineConfig
    ours = EngineConfig(dtype=given, device="cpu").dtype
    return ours, DTYPES[ours]


def batchscope_cmd(folder: Path, port: int, args) -> tuple[list[str], dict]:
    """The server's command and its extra environment (run from this checkout, or from --baseline's: `python -m
    app` imports the app and the engine of the folder it starts in)."""
    cmd = [sys.executable, "-m", "app", "--serving", "--model", str(folder), "--served-model-name", NAME,
           "--port", str(port), "--dtype", dtypes(args.dtype)[0], "--log-level", "warning",
           *args.batchscope_args.split()]
    return cmd, {}


def vllm_cmd(python: str, folder: Path, port: int, args) -> tuple[list[str], dict]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", NAME,
           "--dtype", dtypes(args.dtype)[1], "--max-model-len", "4096", "--port", str(port), "--host", "127.0.0.1",
           "--disable-log-stats"]
    return cmd, {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}   # both cores compute


def vllm_python(given: str | None) -> str | None:
    """The Python that serves vLLM: --vllm-python, else $VLLM_PYTHON; None when neither is set (its row then
    says "not installed"). A ValueError naming the path when it is not there or cannot import vllm."""
    python = given or os.environ.get("VLLM_PYTHON")
    if not python:
        return None
    try:
        ok = subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
    except OSError as e:
        raise ValueError(f"--vllm-python {python}: cannot be run ({e.strerror})") from None
    if not ok:
        raise ValueError(f"--vllm-python {python}: cannot import vllm (scripts/install_vllm.sh makes .venv-vllm)")
    return python


def start(cmd: list[str], env: dict, port: int, timeout: float, cwd: Path = ROOT) -> subprocess.Popen:
    import httpx
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_peers_{port}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{cmd[2]} exited: {log.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{cmd[2]} did not answer /health within {timeout:.0f} s")


async def one(http, prompt: list[int], output_tokens: int, model: str) -> tuple[float | None, list[float], int]:
    """(TTFT, per-token gaps, completion tokens) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    t0 = time.perf_counter()
    first, last, seen, gaps, tokens = None, None, 0, [], 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk, now = json.loads(line[6:]), time.perf_counter()
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            if chunk["choices"] and chunk["choices"][0].get("text"):
                if first is None:
                    first = now - t0
                elif tokens > seen:
                    gaps += [(now - last) / (tokens - seen)] * (tokens - seen)
                last, seen = now, tokens
    return first, gaps, tokens


async def level(url: str, concurrency: int, requests: int, prompt_tokens: int, output_tokens: int, salt: int,
                model: str = NAME):
    import httpx
    prompts = [[(salt * 7919 + 131 * i + j) % 40000 + 200 for j in range(prompt_tokens)] for i in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []

    async def worker(http):
        while not queue.empty():
            results.append(await one(http, queue.get_nowait(), output_tokens, model))
    async with httpx.AsyncClient(base_url=url, timeout=3600, trust_env=False,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    ttft = [r[0] for r in results if r[0] is not None]
    itl = [g for r in results for g in r[1]]
    return {"tok_s": sum(r[2] for r in results) / elapsed, "ttft": (percentile(ttft, 50), percentile(ttft, 99)),
            "itl": (percentile(itl, 50), percentile(itl, 99))}


def row(name: str, c: int, m: dict | None, note: str = "") -> str:
    if m is None:
        return f"| {c} | {name} | {note} | | | | |"
    ms = lambda x: f"{1000 * x:.0f}" if x is not None else "-"
    s = lambda x: f"{x:.2f}" if x is not None else "-"
    return (f"| {c} | {name} | {m['tok_s']:.1f} | {s(m['ttft'][0])} | {s(m['ttft'][1])} | "
            f"{ms(m['itl'][0])} | {ms(m['itl'][1])} |")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=3, help="requests per stream and level")
    p.add_argument("--dtype", default="auto", help="both servers' dtype (auto: bfloat16 with AMX, else float32; "
                                                   "int8: batchscope's int8 linears, vLLM float32)")
    p.add_argument("--batchscope-args", default="", help="more flags for batchscope, e.g. '--cpu-threads 1'")
    p.add_argument("--model", default=None, help="a prepared model folder (default: the embedded model's)")
    p.add_argument("--vllm-python", default=None, help="a Python that imports vllm (default $VLLM_PYTHON)")
    p.add_argument("--start-timeout", type=float, default=1800, help="seconds a server may take to start")
    p.add_argument("--rounds", type=int, default=3, help="rounds in which the servers take turns at each level")
    p.add_argument("--baseline", type=Path, default=None, help="another checkout of batchscope, served beside "
                   "this one with the same flags (e.g. a worktree of an earlier commit)")
    args = p.parse_args()
    try:
        python = vllm_python(args.vllm_python)
    except ValueError as e:
        p.error(str(e))
    if args.baseline and not (args.baseline / "app" / "__main__.py").exists():
        p.error(f"--baseline {args.baseline}: not a checkout of batchscope (no app/__main__.py)")
    from engine.weights.loader import resolve_model
    folder = resolve_model(args.model)
    levels = [int(x) for x in args.concurrency.split(",")]
    ours, theirs = dtypes(args.dtype)
    flags = " ".join(["--serving", args.batchscope_args]).strip()
    servers = [(f"batchscope {flags} ({ours})", lambda port: batchscope_cmd(folder, port, args), ROOT)]
    if args.baseline:
        servers.append((f"baseline {flags} ({ours})", lambda port: batchscope_cmd(folder, port, args),
                        args.baseline.resolve()))
    servers.append((f"vLLM-CPU ({theirs})", (lambda port: vllm_cmd(python, folder, port, args)) if python else None,
                    ROOT))
    print(f"load average before: {load()}; cpu: {cpu_name()}; {args.prompt_tokens}-token prompts, "
          f"{args.output_tokens}-token replies, {args.requests} requests per stream, {args.rounds} rounds")
    running, results = [], {}          # results[(server, level)]: one measurement per round
    try:
        for name, make, cwd in servers:  # every server up first; an idle one waits on its socket, using no CPU
            if make is None:
                print(f"{name}: not installed (give --vllm-python)", file=sys.stderr)
                continue
            port = free_port()
            cmd, env = make(port)
            try:
                proc = start(cmd, env, port, args.start_timeout, cwd)
            except RuntimeError as e:
                print(f"{name}: {e}", file=sys.stderr)
                continue
            running.append((name, f"http://127.0.0.1:{port}", proc))
            asyncio.run(level(running[-1][1], 1, 1, 16, 4, salt=999))                # warm-up
        for r in range(args.rounds):   # the servers take turns at each level, so a load change hits both
            for i, c in enumerate(levels):
                # and the order of the turns rotates, so no server always runs right after the same other one
                # (a server's processes stay up beside the next one's turn)
                k = (r * len(levels) + i) % len(running)
                for name, url, _ in running[k:] + running[:k]:
                    m = asyncio.run(level(url, c, c * args.requests, args.prompt_tokens, args.output_tokens,
                                          salt=100 * r + i))
                    results.setdefault((name, c), []).append(m)
                    print(f"round {r + 1}: " + row(name, c, m), flush=True)
    finally:
        for _, _, proc in running:
            proc.terminate()
            proc.wait(60)
    print(f"\nload average after: {load()}")
    print(f"medians of {args.rounds} rounds (each cell's median over its rounds)")
    print("| concurrency | server | output tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        for name, _, _ in servers:
            ms = results.get((name, c))
            print(row(name, c, median_of(ms)) if ms else row(name, c, None, "did not run (see above)"))
    others = running[1:] if running and running[0][0] == servers[0][0] else []
    for b, _, _ in others:             # this checkout against each other server, round by round
        for c in levels:
            a = servers[0][0]
            ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(results[(a, c)], results[(b, c)])]
            print(f"{c} streams: {a} / {b} output tokens/s, per round: "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}")


def median_of(ms: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs) if all(x is not None for x in xs) else None
    return {"tok_s": statistics.median(m["tok_s"] for m in ms),
            "ttft": tuple(med([m["ttft"][k] for m in ms]) for k in (0, 1)),
            "itl": tuple(med([m["itl"][k] for m in ms]) for k in (0, 1))}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    import platform
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
