"""One workload on batchscope's own engine and on a running vLLM server, one table.

    python -m demos.side_by_side --vllm http://127.0.0.1:8000          # its recorder at 127.0.0.1:8765

vLLM must run batchscope's recording scheduler (docs/vllm.md): both rows are computed by app/readers/metrics.py
from each engine's own StepRecords, so "TBT" and "stall" mean the same thing on both sides. The
workload is demos.bench's (random prompt token ids, replies that ignore EOS, all arriving at once);
batchscope's engine runs it with vLLM's token budget and sequence limit (read from its recorder),
chunked prefill on. The two run one after the other on the same machine; vLLM keeps its own threads.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

import httpx

from app.readers import metrics
from app.serving.attach_records import read_hello
from demos.bench import make_workload, run_ours

COLUMNS = [("tokens/s", "output_tokens_per_s", 1), ("TTFT p50 ms", "ttft_p50_s", 1e3),
           ("TBT p50 ms", "tbt_p50_s", 1e3), ("TBT p99 ms", "tbt_p99_s", 1e3),
           ("longest gap ms", "tbt_max_s", 1e3), ("longest stall ms", "stall_max_s", 1e3),
           ("preemptions", "num_preemptions", 1)]


def run_vllm(url: str, host: str, port: int, model: str, workload) -> tuple[dict, list[dict], dict]:
    """The workload through vLLM's OpenAI API, all at once; its records read from the recorder meanwhile."""
    sock, hello = read_hello(host, port, 10.0)
    stream: list[dict] = []

    def read():
        for line in sock.makefile("rb"):
            stream.append(json.loads(line))
    threading.Thread(target=read, daemon=True).start()

    async def send():
        async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as http:
            async def one(i, prompt, n):
                r = await http.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0,
                    "request_id": f"w{i}"})
                r.raise_for_status()
            await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(workload)))
    asyncio.run(send())
    time.sleep(1.0)                     # the last steps' records are on their way
    sock.close()
    return metrics.summarize(stream), stream, hello


def table(rows: list[tuple[str, dict]]) -> str:
    head = "| system | " + " | ".join(c for c, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for name, s in rows:
        cells = [("—" if s.get(k) is None else f"{s[k] * scale:.1f}" if scale != 1 or isinstance(s[k], float)
                  else str(s[k])) for _, k, scale in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.side_by_side", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", required=True, help="vLLM's OpenAI server, http://HOST:PORT")
    ap.add_argument("--records", default=None, help="its recorder, HOST:PORT (default: the --vllm host, 8765)")
    ap.add_argument("--model", default=None, help="batchscope's model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-range", default="32,512")
    ap.add_argument("--output-range", default="16,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write both summaries here")
    args = ap.parse_args(argv)
    from urllib.parse import urlsplit
    host = urlsplit(args.vllm).hostname
    rhost, _, rport = (args.records or f"{host}:8765").rpartition(":")
    served = httpx.get(f"{args.vllm.rstrip('/')}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
    pr, orng = (tuple(int(x) for x in r.split(",")) for r in (args.prompt_range, args.output_range))
    workload = make_workload(args.requests, pr, orng, 49152, args.seed)
    v_summary, _, hello = run_vllm(args.vllm, rhost, int(rport), served, workload)
    s = hello["settings"]
    print(f"vLLM: {hello['engine']} on {hello['device']}, budget {s['max_num_batched_tokens']}, "
          f"max_num_seqs {s['max_num_seqs']}", file=sys.stderr)
    from engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", policy="chunked", kv_cache_gb=1.0,
                                    max_num_batched_tokens=s["max_num_batched_tokens"],
                                    max_num_seqs=s["max_num_seqs"], cpu_threads=args.cpu_threads))
    engine.generate(["warm up"], SamplingParams(max_tokens=2))     # vLLM warmed up at its start too
    ours, _ = run_ours(engine, workload, progress=False)
    rows = [(f"batchscope chunked ({engine.device})", ours), (f"{hello['engine']} ({hello['device']})", v_summary)]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(args), "vllm_settings": s, "rows": dict(rows)}, f, indent=1)


if __name__ == "__main__":
    main()
