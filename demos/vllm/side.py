"""vLLM's row beside batchscope's, for demos.compare (a scenario) and demos.bench (a workload).

    python -m demos.compare --scenario long-prompt-interrupts --policies chunked --vllm http://127.0.0.1:8000
    python -m demos.compare --scenario long-prompt-interrupts --policies chunked --vllm-start
    python -m demos.bench --skip hf-static,hf-cb,decode --policies chunked --vllm-start

--vllm URL: a running vLLM with batchscope's recording scheduler (docs/vllm.md), its records read at
--vllm-records HOST:PORT (default: the URL's host, 8765). --vllm-start: one is started here from the
vLLM environment (scripts/install_vllm.sh) on the same model folder, with the run's token budget and
sequence limit and dtype (float32 unless named: batchscope's "auto" would pick bfloat16 on a CPU with
AMX), chunked prefill on, -O0 (add flags with --vllm-args), and stopped after.

Both rows are app/readers/metrics.py over each engine's own StepRecords: the same definition of TTFT,
TBT and stall on both sides. Requests go through vLLM's OpenAI API (token ids as a completion prompt,
chats through its chat template), each named by its label as `request_id`. A scenario's step clock is
vLLM's own: an arrival due at step k is sent once the recorder has reported k steps of this run (and at
once while vLLM is idle, as batchscope's replay skips ahead); a wall clock is followed in seconds.
"""
from __future__ import annotations

import asyncio
import json
import math
import shlex
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from app.readers import metrics
from app.serving.attach_records import RecordsUnavailable, read_hello

COLUMNS = [("tokens/s", "output_tokens_per_s", 1), ("TTFT p50 ms", "ttft_p50_s", 1e3),
           ("TTFT p99 ms", "ttft_p99_s", 1e3), ("TBT p50 ms", "tbt_p50_s", 1e3), ("TBT p99 ms", "tbt_p99_s", 1e3),
           ("longest gap ms", "tbt_max_s", 1e3), ("longest stall ms", "stall_max_s", 1e3),
           ("preemptions", "num_preemptions", 1), ("steps", "num_steps", 1)]


@dataclass
class Vllm:
    """A vLLM server with the recorder: its API, its record stream's address and its hello."""
    url: str
    records: tuple[str, int]
    model: str = ""
    hello: dict = field(default_factory=dict)

    @property
    def settings(self) -> dict:
        return self.hello.get("settings", {})

    @property
    def dtype(self) -> str:
        """The dtype vLLM computes in (the recorder's `device` is `cpu/float32`)."""
        return str(self.hello.get("device", "")).partition("/")[2] or "float32"

    @property
    def name(self) -> str:
        s = self.settings
        return f"vllm-{s.get('policy', '?')}"


def connect(url: str, records: str | None = None) -> Vllm:
    """Checks that vLLM answers and publishes records; SystemExit naming what is missing otherwise."""
    url = url.rstrip("/").removesuffix("/v1")
    host, _, port = (records or f"{urlsplit(url).hostname}:8765").rpartition(":")
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"vLLM does not answer at {url}/v1/models ({e or type(e).__name__}): start it first "
                         f"(docs/vllm.md) or use --vllm-start") from None
    try:
        sock, hello = read_hello(host, int(port), 10.0)
    except RecordsUnavailable as e:
        raise SystemExit(str(e)) from None
    sock.close()
    return Vllm(url, (host, int(port)), model, hello)


@contextmanager
def started(model: str | None, budget: int, seqs: int, extra: str = "", chunk: int | None = None,
            dtype: str = "float32", log_dir: str | None = None):
    """A vLLM server from the vLLM environment on batchscope's model folder (the default model unless
    named), with this budget, sequence limit and prompt chunk cap; stopped on exit."""
    from demos.vllm import server as vs
    if vs.vllm_python() is None:
        raise SystemExit("--vllm-start needs the vLLM environment: bash scripts/install_vllm.sh makes .venv-vllm "
                         "(or name its python in BATCHSCOPE_VLLM_PYTHON)")
    folder = vs.folder_for(model)
    port, records = vs.free_port(), vs.free_port()
    log = Path(log_dir or tempfile.mkdtemp(prefix="vllm-")) / "vllm.log"
    flags = ["--max-num-batched-tokens", str(budget), "--max-num-seqs", str(seqs), "--optimization-level", "0",
             "--dtype", dtype]
    if chunk:
        flags += ["--long-prefill-token-threshold", str(chunk)]
    proc = vs.start(folder, port, records, log, *flags, *shlex.split(extra), kv_cache_gb=1)
    print(f"starting vLLM ({folder.name}, budget {budget}, max_num_seqs {seqs}; log {log})", file=sys.stderr)
    try:
        ready = vs.wait_ready(proc, port, log)
        print(f"vLLM answered after {ready:.0f} s", file=sys.stderr)
        yield connect(f"http://127.0.0.1:{port}", f"127.0.0.1:{records}")
    finally:
        vs.stop(proc)


def _body(vllm: Vllm, label: str, max_tokens: int, prompt=None, messages=None, temperature: float = 0.0,
          seed: int | None = None) -> tuple[str, dict]:
    body = {"model": vllm.model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": temperature,
            "request_id": label, "user": label}
    if seed is not None:
        body["seed"] = seed
    if messages is not None:
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": prompt}


class Recording:
    """The record stream of one run, read on a thread from the moment it connects."""

    def __init__(self, vllm: Vllm):
        self.sock, _ = read_hello(*vllm.records, 10.0)
        self.stream: list[dict] = []
        self.steps = 0
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        try:
            for line in self.sock.makefile("rb"):
                obj = json.loads(line)
                self.stream.append(obj)
                self.steps += obj.get("type") == "step"
        except (OSError, ValueError):
            pass

    def close(self) -> list[dict]:
        time.sleep(0.5)                 # the last steps' records are on their way (the sender writes every 20 ms)
        self.sock.close()
        self._thread.join(2)
        return list(self.stream)


async def _send(http: httpx.AsyncClient, path: str, body: dict):
    r = await http.post(path, json=body)
    if r.status_code != 200:
        raise SystemExit(f"vLLM refused a request ({r.status_code}): {r.text[:300]}")


def warm_up(vllm: Vllm):
    """One short request first (vLLM warmed its model up at start; this warms the API path)."""
    async def go():
        async with httpx.AsyncClient(base_url=vllm.url, timeout=None, trust_env=False) as http:
            await _send(http, *_body(vllm, "warm-up", 2, prompt="Hello"))
    asyncio.run(go())


def run_workload(vllm: Vllm, workload: list[tuple[list[int], int]]) -> tuple[dict, list[dict]]:
    """demos.bench's workload (prompt token ids, reply lengths, all at t=0) through vLLM: (summary, stream)."""
    warm_up(vllm)
    rec = Recording(vllm)

    async def go():
        async with httpx.AsyncClient(base_url=vllm.url, timeout=None, trust_env=False) as http:
            await asyncio.gather(*(_send(http, *_body(vllm, f"w{i}", n, prompt=list(p)))
                                   for i, (p, n) in enumerate(workload)))
    asyncio.run(go())
    stream = rec.close()
    return metrics.summarize(stream), stream


def run_scenario(vllm: Vllm, scenario) -> list[dict]:
    """A scenario's arrivals (app/replay/scenarios.py) through vLLM, on its clock; the stream of the run."""
    warm_up(vllm)
    rec = Recording(vllm)

    async def go():
        async with httpx.AsyncClient(base_url=vllm.url, timeout=None, trust_env=False) as http:
            t0, base, tasks = time.monotonic(), rec.steps, []
            for a in scenario.arrivals:
                while True:
                    if scenario.clock == "wall":
                        due = time.monotonic() - t0 >= a.at
                    else:                   # vLLM's steps of this run; idle: the next arrival comes at once
                        due = rec.steps - base >= a.at or all(t.done() for t in tasks)
                    if due:
                        break
                    await asyncio.sleep(0.005)
                prompt = list(a.prompt_token_ids) if a.prompt_token_ids is not None else a.prompt
                messages = [dict(m) for m in a.messages] if a.messages is not None else None
                tasks.append(asyncio.ensure_future(_send(http, *_body(
                    vllm, a.label, a.max_tokens, prompt=prompt, messages=messages, temperature=a.temperature,
                    seed=a.seed))))
                if scenario.clock == "step" and all(t.done() for t in tasks[:-1]):
                    base = min(base, rec.steps - math.ceil(a.at))   # skipped ahead to this arrival's step
            await asyncio.gather(*tasks)
    asyncio.run(go())
    return rec.close()


def request_ids(stream: list[dict], labels: list[str]) -> list[str | None]:
    """vLLM's id of each arrival, by label in arrival order (the recorder's `arrived` events)."""
    seen: dict[str, list[str]] = {}
    for e in metrics.events(stream, "arrived"):
        seen.setdefault(e["label"], []).append(e["req"])
    return [seen.get(label, []).pop(0) if seen.get(label) else None for label in labels]


def table(rows: list[tuple[str, dict]]) -> str:
    """One markdown table, a row per system: every number from app/readers/metrics.py's summarize."""
    lines = ["| system | " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for name, s in rows:
        cells = ["–" if s.get(k) is None else f"{s[k] * scale:,.1f}" if scale != 1 or isinstance(s[k], float)
                 else str(s[k]) for _, k, scale in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(ap):
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--vllm", default=None, metavar="URL", help="also run on this vLLM server (with batchscope's "
                   "recording scheduler, docs/vllm.md)")
    g.add_argument("--vllm-start", action="store_true", help="also run on a vLLM started here from the vLLM "
                   "environment on the same model (scripts/install_vllm.sh)")
    ap.add_argument("--vllm-records", default=None, metavar="HOST:PORT", help="--vllm's record stream "
                    "(default: its host, 8765)")
    ap.add_argument("--vllm-args", default="", help="--vllm-start: more vLLM flags, one string")


def named(args) -> Vllm | None:
    """--vllm's server, checked (before batchscope's runs: they take its budgets)."""
    return connect(args.vllm, args.vllm_records) if args.vllm else None


@contextmanager
def serving(args, vllm: Vllm | None, model: str | None, budget: int, seqs: int, chunk: int | None = None,
            dtype: str = "float32"):
    """--vllm's server as it is, or --vllm-start's, started now (after batchscope's runs, so that it
    never shares the CPU with them) with batchscope's budgets; None without either flag."""
    if vllm is not None or not args.vllm_start:
        yield vllm
    else:
        with started(model, budget, seqs, args.vllm_args, chunk, dtype) as v:
            yield v
