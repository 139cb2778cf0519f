"""What the recording scheduler costs a vLLM server: the same server started twice, with and without
`--scheduler-cls integrations.vllm.RecordingScheduler`, the same workload sent to each in turn.

    python -m demos.vllm.recorder_tokens                      # the default model, 5 rounds, -O0: ~4 minutes
    python -m demos.vllm.recorder_tokens --rounds 7 --requests 8 --prompt 128 --output 64 --opt 3

Both servers run from the vLLM environment (scripts/install_vllm.sh) on the same model folder and
flags, side by side; only one of them has work at a time. Each round sends the workload (--requests
prompts of --prompt random token ids, all at once, replies of exactly --output tokens) to one server,
then to the other, the first of the pair alternating between rounds, so a machine whose speed drifts
slows both alike. The recording server's records are read all along by a client, as attach mode reads
them. Reported: each side's median output tokens/s (tokens / wall seconds of the round, as a client
sees it) and the ratio of the medians, with the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from demos.vllm import server as vs


def read_records(port: int, count: list[int]):
    """A reader of the recorder's stream, as attach mode is: every line read, counted."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.settimeout(None)
    for _ in sock.makefile("rb"):
        count[0] += 1


async def one_round(url: str, prompts: list[list[int]], output: int, tag: str) -> tuple[int, float]:
    """(reply tokens, seconds) of the workload sent all at once."""
    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as http:
        async def ask(i: int, p: list[int]) -> int:
            r = await http.post("/v1/completions", json={"model": vs.SERVED_NAME, "prompt": p, "max_tokens": output,
                                                         "ignore_eos": True, "temperature": 0,
                                                         "request_id": f"{tag}{i}"})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        t = time.perf_counter()
        tokens = await asyncio.gather(*(ask(i, p) for i, p in enumerate(prompts)))
        return sum(tokens), time.perf_counter() - t


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.vllm.recorder_tokens", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="batchscope's model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; each sends the workload to both servers")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=48, help="reply tokens per request")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--opt", type=int, default=0, help="vLLM's -O level (0: no compile, starts in about a minute)")
    ap.add_argument("--json", default=None, help="also write every round's numbers here")
    args = ap.parse_args(argv)
    if vs.vllm_python() is None:
        sys.exit("no vLLM environment: bash scripts/install_vllm.sh makes .venv-vllm")
    folder = vs.folder_for(args.model)
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-recorder-"))
    flags = ["--max-num-batched-tokens", str(args.budget), "--max-num-seqs", str(args.requests),
             "--optimization-level", str(args.opt)]
    sides = {}
    t0 = time.perf_counter()
    for name, recorder in (("alone", False), ("recording", True)):
        port, records = vs.free_port(), vs.free_port()
        proc = vs.start(folder, port, records, logs / f"{name}.log", *flags, kv_cache_gb=1, recorder=recorder)
        sides[name] = {"proc": proc, "port": port, "records": records, "url": f"http://127.0.0.1:{port}"}
    try:
        for name, s in sides.items():
            ready = vs.wait_ready(s["proc"], s["port"], logs / f"{name}.log")
            print(f"{name}: answered after {ready:.0f} s", file=sys.stderr)
        count = [0]
        threading.Thread(target=read_records, args=(sides["recording"]["records"], count), daemon=True).start()
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 49152) for _ in range(args.prompt)] for _ in range(args.requests)]
        for s in sides.values():                 # a warm-up round each, the whole workload, not counted
            asyncio.run(one_round(s["url"], prompts, 8, "warm"))
        rates = {name: [] for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                tokens, seconds = asyncio.run(one_round(sides[name]["url"], prompts, args.output, f"r{r}-"))
                rates[name].append(tokens / seconds)
                print(f"round {r + 1} {name:9} {tokens / seconds:7.1f} tok/s ({tokens} tokens, {seconds:.1f} s)",
                      file=sys.stderr)
    finally:
        for s in sides.values():
            vs.stop(s["proc"])
    med = {name: statistics.median(v) for name, v in rates.items()}
    ratio = med["recording"] / med["alone"]
    load = os.getloadavg()[0]
    print(f"vLLM alone      {med['alone']:7.1f} tok/s (median of {args.rounds})")
    print(f"vLLM recording  {med['recording']:7.1f} tok/s (median of {args.rounds}; {count[0]} record lines read)")
    print(f"recording / alone: {ratio:.3f}   (load average {load:.1f} on {os.cpu_count()} cores; "
          f"{time.perf_counter() - t0:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rates, "median": med, "ratio": ratio, "load": load,
                                               "records_read": count[0], "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
