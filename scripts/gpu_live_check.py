"""The live server on a GPU (docs/gpu.md): `python -m app` serving a random model at real shapes,
8 streaming chats through the official openai client while long documents arrive, under chunked and
then continuous, the step stream read from /ws/steps, and the stall and time-between-tokens ratios
computed by app/readers/metrics.py from the streamed records. Writes one JSON file.

    python3 scripts/gpu_live_check.py --out gpu_live.json                 # on a GPU, about 2 minutes
    python3 scripts/gpu_live_check.py --quick --device cpu --out live.json  # tiny model, CPU

Needs the web stack (fastapi, uvicorn, websockets, openai, ...; not gradio): docs/gpu.md lists the
wheels to bring to a GPU machine that lacks them.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check import build_model  # noqa: E402

from app.readers import metrics  # noqa: E402

FULL = dict(model="qwen2.5-0.5b", vocab=151936, chats=8, chat_prompt=64, chat_tokens=200, docs=6, doc_prompt=4000,
            doc_every_s=0.4, budget=256, max_num_seqs=16, max_model_len=8192)
QUICK = dict(model="tiny", vocab=1024, chats=3, chat_prompt=8, chat_tokens=150, docs=2, doc_prompt=150,
             doc_every_s=0.1, budget=32, max_num_seqs=8, max_model_len=512)
KEY = "gpu-live-check"


def start_server(folder: Path, p: dict, device: str) -> tuple[subprocess.Popen, str, list[str]]:
    env = {**os.environ, "PRESENTER_KEY": KEY}
    cmd = [sys.executable, "-m", "app", "--model", str(folder), "--device", device, "--port", "0",
           "--policy", "chunked", "--max-num-batched-tokens", str(p["budget"]), "--max-num-seqs",
           str(p["max_num_seqs"]), "--max-model-len", str(p["max_model_len"])]
    if device == "cpu":
        cmd += ["--kv-cache-gb", "0.1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def pump():
        for line in proc.stdout:
            output.append(line)
            lines.put(line)
        lines.put("")
    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 300
    while True:
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
        if not line:
            raise RuntimeError("the server exited before serving:\n" + "".join(output[-40:]))
        if m := re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", line):
            return proc, m.group(1), output


class StepStream:
    """Every record /ws/steps sends, from connect to close, in a thread of its own."""

    def __init__(self, url: str):
        from websockets.sync.client import connect
        self.ws = connect(url.replace("http://", "ws://") + "/ws/steps", open_timeout=30, max_size=1 << 24)
        self.records: list[dict] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for text in self.ws:
                obj = json.loads(text)
                self.records.extend(obj.get("records", []) if obj.get("type") == "snapshot" else [obj])
        except Exception:
            pass

    def close(self):
        self.ws.close()
        self.thread.join(timeout=10)


def text(rng: random.Random, n: int) -> str:
    """n tokens of text for the synthetic byte-level tokenizer (one token per letter)."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))


def run_policy(url: str, stream: StepStream, policy: str, p: dict) -> dict:
    import httpx
    import openai
    httpx.post(url + "/api/engine", json={"policy": policy}, headers={"X-Presenter-Key": KEY}, timeout=30,
               trust_env=False).raise_for_status()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=600))
    rng = random.Random(7)
    chats, errors = [], []

    def one(content: str, max_tokens: int, ids: list):
        try:
            s = client.chat.completions.create(model="model", messages=[{"role": "user", "content": content}],
                                               max_tokens=max_tokens, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})   # replies of known length
            for chunk in s:
                if chunk.id and not ids:
                    ids.append(chunk.id.removeprefix("chatcmpl-"))
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:300])
    first = len(stream.records)
    t0 = time.perf_counter()
    threads = []
    for _ in range(p["chats"]):
        ids: list[str] = []
        chats.append(ids)
        threads.append(threading.Thread(target=one, args=(text(rng, p["chat_prompt"]), p["chat_tokens"], ids)))
        threads[-1].start()
    time.sleep(p["doc_every_s"])
    for _ in range(p["docs"]):                       # long documents arrive while the chats reply
        threads.append(threading.Thread(target=one, args=(text(rng, p["doc_prompt"]), 8, [])))
        threads[-1].start()
        time.sleep(p["doc_every_s"])
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    time.sleep(1.0)                                  # the last records reach the stream
    recs = stream.records[first:]
    chat_ids = [x[0] for x in chats if x]
    s = metrics.summarize(recs, reqs=chat_ids)
    return {"seconds": secs, "errors": errors, "records": len(recs), "steps": s["num_steps"],
            "chat_tbt_p50_ms": _ms(s["tbt_p50_s"]), "chat_tbt_p99_ms": _ms(s["tbt_p99_s"]),
            "chat_tbt_max_ms": _ms(s["tbt_max_s"]), "stall_count": s["stall_count"],
            "stall_max_ms": _ms(s["stall_max_s"]), "output_tokens_per_s": s["output_tokens_per_s"]}


def _ms(x):
    return None if x is None else x * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_live.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    p = QUICK if args.quick else FULL
    res = {"model": p["model"], "device": args.device, "settings": {k: v for k, v in p.items() if k != "vocab"}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(p["model"], p["vocab"], Path(tmp) / "model", "cpu")
        proc, url, output = start_server(folder, p, args.device)
        try:
            res["healthz"] = json.loads(__import__("httpx").get(url + "/healthz", trust_env=False).text)
            stream = StepStream(url)
            run_policy(url, stream, "chunked", {**p, "chats": 1, "docs": 1})   # warm-up
            for policy in ("chunked", "continuous"):
                res[policy] = run_policy(url, stream, policy, p)
            stream.close()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    c, k = res["chunked"], res["continuous"]
    ratio = lambda a, b: a / b if a and b else None
    res["targets"] = {"chat_tbt_p99_continuous_over_chunked": ratio(k["chat_tbt_p99_ms"], c["chat_tbt_p99_ms"]),
                      "stall_max_continuous_over_chunked": ratio(k["stall_max_ms"], c["stall_max_ms"]),
                      "chunked_stall_free": c["stall_count"] == 0 and not c["errors"],
                      "throughput_chunked_over_continuous": ratio(c["output_tokens_per_s"], k["output_tokens_per_s"])}
    Path(args.out).write_text(json.dumps(res, indent=2))
    for name, v in res["targets"].items():
        print(f"live {name:44s} {'-' if v is None else v if isinstance(v, bool) else f'{v:.3f}'}")


if __name__ == "__main__":
    main()
