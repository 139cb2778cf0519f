"""The CPU kernels of the engine (engine/kernels/ops.py) against what torch offers for the same op,
side by side: a kernel stays only where it wins here.

    python -m demos.bench.ops                  # torch's thread count
    python -m demos.bench.ops --threads 1 --only chains,kv_write

linears     the default model's 30 layers of linears and its logits head at 1 to 512 rows, fp32:
            F.linear against engine.models.fast_paths.linear (output features cut into one slice
            per thread, one batched matmul), oneDNN's packed kernel and, on AVX-512, the
            engine's own kernel (engine.kernels.ops.linear_f32), which the engine takes at every
            row count where it is built.
prefill     fresh prompt chunks' causal attention, 30 layers, fp32: SDPA (one call per run of
            chunks, as TorchAttention) against the engine's kernel (ops.causal_prefill_or_none).
attention   one layer's decode attention over a paged cache with scattered block tables:
            one SDPA call per sequence and one batched call over blocks gathered by tensor
            indexing (the two earlier engine paths) against TorchAttention.decode (one call
            per group of similar contexts, blocks gathered by index_select) and the engine's
            paged kernel (ops.paged_decode, in its own layout inside a block).
chains      the elementwise chains (RMSNorm with the residual add, SiLU-and-multiply, RoPE) of 30
            layers, fp32 and bf16: torch eager (the plain path), torch.compile (Inductor's fused
            C++; its compile time is printed apart: it delays the first reply) and the kernels.
kv_write    a step's keys and values into the paged cache, 30 layers: one index_put_ per cache in
            the kernel's layout (engine/kernels/reference.write_kv) against ops.write_kv.

The variants take turns in each round; the table gives medians and the median of the
per-round ratios. Shapes are SmolLM2-135M's; the weights are random (time does not depend
on the values)."""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from demos.bench.against_hf import cpu_facts
from demos.compare.scenario import machine
from engine.execution.attention import AttentionMetadata, TorchAttention, sdpa
from engine.execution.model_runner import keep_freed_memory
from engine.kernels import cpu_kernels, ops
from engine.models.fast_paths import linear, pack, packed_linear, packed_weights_work

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LINEARS = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN),
           (HIDDEN, INTER)]


def rounds_of(variants: dict, rounds: int) -> dict:
    """{name: fn} -> {name: [seconds per round]}, the variants taking turns; round 0 is dropped."""
    out = {k: [] for k in variants}
    for _ in range(rounds + 1):
        for k, f in variants.items():
            t = time.perf_counter()
            f()
            out[k].append(time.perf_counter() - t)
    return {k: v[1:] for k, v in out.items()}


def row(times: dict, base: str) -> list[str]:
    cells = []
    for k, v in times.items():
        cells.append(f"{statistics.median(v) * 1e3:.2f}")
        if k != base:
            cells.append(f"{statistics.median(b / x for b, x in zip(times[base], v)):.2f}x")
    return cells


def linears(rounds: int, rows=(1, 8, 32, 128, 512)):
    weights = [torch.randn(n, k) / k ** 0.5 for _ in range(LAYERS) for n, k in LINEARS] + [torch.randn(VOCAB, HIDDEN)]
    variants = {"F.linear": lambda x, w, i: F.linear(x, w), "split": lambda x, w, i: linear(x, w)}
    if packed_weights_work(torch.float32):
        onednn = [pack(w) for w in weights]
        variants["oneDNN"] = lambda x, w, i: packed_linear(x, onednn[i])
    if cpu_kernels.f32_linears():
        own = [ops.pack_f32(w) for w in weights]
        variants["kernel"] = lambda x, w, i: ops.linear_f32(x, own[i], w.shape[0])
    others = [k for k in variants if k != "F.linear"]
    print("\n| rows | F.linear ms | " + " | ".join(f"{k} ms | F.linear / {k}" for k in others) + " |\n|---:|---:|"
          + "---:|---:|" * len(others))
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        times = rounds_of({k: lambda f=f: [f(xs[w.shape[1]], w, i) for i, w in enumerate(weights)]
                           for k, f in variants.items()}, rounds if m < 128 else 3)
        print(f"| {m} | " + " | ".join(row(times, "F.linear")) + " |")


def prefill(rounds: int, cases=((8, 256), (1, 2048), (4, 100))):
    print("\n| chunks x tokens | SDPA ms | kernel ms | SDPA / kernel |\n|---|---:|---:|---:|")
    for m, n in cases:
        qkv = torch.randn(m * n, HEADS + 2 * KV_HEADS, HEAD_DIM)       # rows of the fused projection, as served
        q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
        times = rounds_of({"sdpa": lambda: [TorchAttention().causal(q, k, v, m) for _ in range(LAYERS)],
                           "kernel": lambda: [ops.causal_prefill_or_none(q, k, v, m) for _ in range(LAYERS)]}, rounds)
        print(f"| {m} x {n} | " + " | ".join(row(times, "sdpa")) + " |")


def attention(rounds: int, cases=((1, 512), (8, 512), (32, 512), (8, 64), (32, 128), (8, 1500))):
    num_blocks = 4096
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM),
                        torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
    kernel = cpu_kernels.supports(torch.float32, BLOCK, HEAD_DIM)
    print("\n| decodes x context | per sequence ms | gathered by indexing ms | vs per sequence | engine ms "
          "| vs per sequence |" + (" kernel ms | vs per sequence |" if kernel else "")
          + "\n|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if kernel else ""))
    rng = random.Random(0)
    for n, ctx0 in cases:
        ctxs = [max(1, ctx0 - rng.randrange(40)) for _ in range(n)]
        width = -(-max(ctxs) // BLOCK)
        tables = torch.randperm(num_blocks)[:n * width].view(n, width)     # scattered blocks
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), context_lens=torch.tensor(ctxs),
                                 block_tables=tables, num_decodes=n, decode_ctx=ctxs)
        q = torch.randn(n, HEADS, HEAD_DIM)
        mask = (torch.arange(width * BLOCK)[None] < meta.context_lens[:, None])[:, None, None]

        def each():
            for i, c in enumerate(ctxs):
                kc = k_cache[tables[i]].flatten(0, 1)[:c].transpose(0, 1)[None]
                vc = v_cache[tables[i]].flatten(0, 1)[:c].transpose(0, 1)[None]
                sdpa(q[i, :, None][None], kc, vc)

        def indexed():
            kc, vc = (c[tables].flatten(1, 2).transpose(1, 2) for c in (k_cache, v_cache))
            sdpa(q.unsqueeze(2), kc, vc, attn_mask=mask)

        def engine():
            meta.derived.clear()                      # the engine plans once per step, in its first layer
            TorchAttention().decode(q, k_cache, v_cache, meta)
        variants = {"each": each, "indexed": indexed, "engine": engine}
        if cpu_kernels.supports(torch.float32, BLOCK, HEAD_DIM):   # the cache's layout differs; not its time
            variants["kernel"] = lambda: ops.paged_decode(q, k_cache, v_cache, tables, meta.context_lens)
        times = rounds_of(variants, rounds)
        print(f"| {n} x {ctx0} | " + " | ".join(row(times, "each")) + " |")


def chains(rounds: int, rows=(1, 8, 32, 128, 512, 2048)):
    from engine.kernels import reference as ref

    def layers(norm, silu, rope, x, res, w, gu, qk, cos, sin):
        for _ in range(LAYERS):
            norm(x, res, w, 1e-5)
            norm(x, res, w, 1e-5)
            silu(gu, INTER)
            rope(qk, cos, sin)
    kernels = (ops.add_rms_norm, ops.silu_and_mul, ops.rope)
    print("\n| dtype, rows | eager ms | compiled ms | eager / compiled | kernel ms | eager / kernel | compile s |"
          "\n|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        torch._dynamo.reset()
        compiled = [torch.compile(f, dynamic=True) for f in (ref.add_rms_norm, ref.silu_and_mul, ref.apply_rope)]
        for m in rows:
            r = lambda *shape: torch.randn(*shape).to(dtype)                   # noqa: E731
            args = (r(m, HIDDEN), r(m, HIDDEN), r(HIDDEN), r(m, 2 * INTER),
                    r(m, HEADS + 2 * KV_HEADS, HEAD_DIM)[:, :HEADS + KV_HEADS], r(m, 1, HEAD_DIM), r(m, 1, HEAD_DIM))
            t = time.perf_counter()
            layers(*compiled, *args)                   # the first call compiles (dynamic shapes: once per dtype)
            first = time.perf_counter() - t
            variants = {"eager": lambda: layers(ref.add_rms_norm, ref.silu_and_mul, ref.apply_rope, *args),
                        "compiled": lambda: layers(*compiled, *args)}
            if cpu_kernels.fused_chains():
                variants["kernel"] = lambda: layers(*kernels, *args)
            times = rounds_of(variants, rounds if m < 2048 else 3)
            print(f"| {str(dtype).removeprefix('torch.')}, {m} | " + " | ".join(row(times, "eager"))
                  + f" | {first:.1f} |")


def kv_write(rounds: int, tokens=(1, 8, 32, 128, 512, 2048)):
    from engine.kernels import reference as ref
    print("\n| tokens | index_put_ ms | kernel ms | index_put_ / kernel |\n|---:|---:|---:|---:|")
    for dtype in (torch.float32,):
        k_cache, v_cache = (torch.zeros(4096, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2))
        for n in tokens:
            qkv = torch.randn(n, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
            k, v = qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
            slots = torch.randperm(4096 * BLOCK)[:n]
            times = rounds_of({"index_put": lambda: [ref.write_kv(k, v, k_cache, v_cache, slots)
                                                     for _ in range(LAYERS)],
                               "kernel": lambda: [ops.write_kv(k, v, k_cache, v_cache, slots)
                                                  for _ in range(LAYERS)]}, rounds)
            print(f"| {n} | " + " | ".join(row(times, "index_put")) + " |")


SECTIONS = ("linears", "attention", "prefill", "chains", "kv_write")


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.bench.ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        ap.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; choose from {', '.join(SECTIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    m, facts = machine(), cpu_facts()
    print(f"{m['date']}, {m['cpu']} ({m['cpu_count']} cores; flags {', '.join(facts['cpu_flags']) or 'none read'}; "
          f"load average {facts['load_average_1min']}), torch {m['torch']}, {m['torch_threads']} thread(s); "
          f"medians of {args.rounds} rounds")
    keep_freed_memory()                 # freed buffers stay mapped: no page faults timed
    with torch.inference_mode():
        for name in SECTIONS:
            if name in only and (name != "prefill" or cpu_kernels.avx512()):   # the causal kernel needs AVX-512
                if name == "kv_write" and not cpu_kernels.fused_chains():
                    continue
                globals()[name](args.rounds)


if __name__ == "__main__":
    main()
