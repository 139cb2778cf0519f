"""One engine step and its attention, this checkout against another, on the CPU, taking turns.

    python demos/bench/step.py --baseline PATH [--dtype float32,bfloat16] [--decodes 8,32] [--context 300]
    python demos/bench/step.py                      # this checkout only

Each code tree (this one, and the checkout at --baseline, e.g. a worktree of the previous commit)
runs in its own worker process with the default model's real weights. For every case the
parent asks the workers for one timed repetition each in turn, so both see the same load, and
prints medians and the median of the per-round ratios (baseline / this: above 1 is faster).

Cases, at each dtype:
  decode N      a step of N decoding sequences with about --context tokens of context each
                (blocks laid out as serving leaves them: each prompt's blocks in one run, the
                decode blocks interleaved between the sequences), forward and sampling
  attention N   the same step's 30 attention calls alone (the backend on random q, k, v)
  prefill       one step of 8 fresh 256-token prompts (a 2048-token budget, the serving preset)

Numbers depend on the machine's load: on a shared machine read the ratios, not the milliseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent.parent


# ---- worker: one code tree, one model ----
def worker(root: str, dtype: str, threads: int | None):
    sys.path.insert(0, root)
    import torch

    from engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams
    try:
        from engine.execution.attention import set_metadata
        from engine.scheduling.scheduler import Batch
        from engine.scheduling.sequence import Sequence
    except ImportError:                     # a tree from before engine/ had folders (577f20c and older)
        from engine.attention import set_metadata
        from engine.scheduler import Batch
        from engine.sequence import Sequence

    engine = LLMEngine(EngineConfig(dtype=dtype, kv_cache_gb=1.0, cpu_threads=threads, max_num_seqs=64,
                                    max_num_batched_tokens=2048, enable_prefix_caching=False))
    runner = engine.runner
    bs, free = runner.block_size, iter(range(runner.num_blocks))
    params = SamplingParams(max_tokens=1024, temperature=0.0)

    def seq(i: int, prompt: int, outputs: int) -> Sequence:
        s = Sequence(f"s{i}", "bench", [(1000 + 37 * i + j) % 40000 + 100 for j in range(prompt)], params, 0.0)
        s.output_token_ids = [(7 * i + j) % 40000 + 100 for j in range(outputs)]
        s.block_table = [next(free) for _ in range(-(-prompt // bs))]
        return s

    def decode_batch(n: int, context: int) -> Batch:
        seqs = [seq(i, 256, context - 256 - i % 40) for i in range(n)]
        while any(len(s.block_table) * bs < s.num_tokens for s in seqs):   # decode blocks, interleaved
            for s in seqs:
                if len(s.block_table) * bs < s.num_tokens:
                    s.block_table.append(next(free))
        for s in seqs:
            s.num_computed_tokens = s.num_tokens - 1
        return Batch(items=[(s, 1) for s in seqs])

    prefill = Batch(items=[(seq(1000 + i, 256, 0), 256) for i in range(8)])
    m = runner.model
    heads, kvh, d = m.cfg.num_attention_heads, m.cfg.num_key_value_heads, m.head_dim

    def attention(batch: Batch):
        step = runner.prepare(batch)
        _, _, _, meta = runner.upload(step)
        n = len(step.input_ids)
        q = torch.randn(n, heads, d, dtype=runner.dtype)
        k, v = torch.randn(n, kvh, d, dtype=runner.dtype), torch.randn(n, kvh, d, dtype=runner.dtype)
        set_metadata(meta)
        for layer in m.layers:
            a = layer.self_attn
            a.backend(q, k, v, a.k_cache, a.v_cache, meta)
        set_metadata(None)

    cases, batches = {}, {}
    for line in sys.stdin:
        name = line.strip()
        if name not in cases:
            kind, _, n = name.partition(" ")
            if kind == "prefill":
                cases[name] = lambda: runner.run(prefill)
            else:
                if n not in batches:                                # attention N and decode N: one batch
                    batches[n] = decode_batch(int(n), CONTEXT)
                batch = batches[n]
                cases[name] = (lambda b=batch: runner.run(b)) if kind == "decode" else (lambda b=batch: attention(b))
            cases[name]()                                           # warm-up
        with torch.inference_mode():
            t0 = time.perf_counter()
            cases[name]()
            dt = time.perf_counter() - t0
        print(json.dumps(dt), flush=True)


CONTEXT = int(os.environ.get("BENCH_CONTEXT", "300"))


# ---- parent ----
class Worker:
    def __init__(self, root: Path, dtype: str, threads: int | None, context: int):
        cmd = [sys.executable, __file__, "--worker", str(root), "--dtype", dtype]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "BENCH_CONTEXT": str(context)})

    def time(self, case: str) -> float:
        self.proc.stdin.write(case + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker stopped (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, default=None, help="another checkout of this project to compare with")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--decodes", default="8,32")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.dtype, args.threads)
    print(f"load average {os.getloadavg()[0]:.2f} at start; cpu: {_cpu()}")
    cases = [f"{k} {n}" for n in args.decodes.split(",") if n for k in ("attention", "decode")]
    cases += [] if args.no_prefill else ["prefill 8x256"]
    for dtype in args.dtype.split(","):
        trees = {"this": HERE} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
        workers = {name: Worker(root, dtype, args.threads, args.context) for name, root in trees.items()}
        try:
            print(f"\n{dtype}, context ~{args.context}, medians of {args.rounds} rounds (ms)")
            print("| case | " + " | ".join(workers) + (" | baseline / this |" if args.baseline else " |"))
            print("|---" * (len(workers) + 1 + bool(args.baseline)) + "|")
            for case in cases:
                times = {name: [] for name in workers}
                for _ in range(args.rounds):
                    for name, w in workers.items():
                        times[name].append(w.time(case))
                cells = [f"{statistics.median(t) * 1e3:.1f}" for t in times.values()]
                if args.baseline:
                    cells.append(f"{statistics.median(b / t for b, t in zip(times['baseline'], times['this'])):.2f}x")
                print(f"| {case} | " + " | ".join(cells) + " |", flush=True)
        finally:
            for w in workers.values():
                w.close()
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")), "unknown")
    flags = set(next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), []))
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} cores, flags {' '.join(wanted) or 'none of avx2/avx512/amx'}"


if __name__ == "__main__":
    main()
