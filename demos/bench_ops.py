"""The two CPU decode kernels of the engine against the plain torch calls they replace, side by side.

    python -m demos.bench_ops                  # torch's thread count
    python -m demos.bench_ops --threads 1

linears     the default model's 30 layers of linears and its logits head at 1 to 512 rows:
            F.linear against engine.models.linears.linear (output features cut into one slice
            per thread, one batched matmul).
attention   one layer's decode attention over a paged cache with scattered block tables:
            one SDPA call per sequence and one batched call over blocks gathered by tensor
            indexing (the two earlier engine paths) against TorchAttention.decode (one call
            per group of similar contexts, blocks gathered by index_select).

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

from demos.bench import cpu_facts
from demos.compare import machine
from engine.attention import AttentionMetadata, TorchAttention, sdpa
from engine.models.linears import linear

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LINEARS = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


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
    print("\n| rows | F.linear ms | split ms | speed-up |\n|---:|---:|---:|---:|")
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        times = rounds_of({"F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                           "split": lambda: [linear(xs[w.shape[1]], w) for w in weights]}, rounds if m < 128 else 3)
        print(f"| {m} | " + " | ".join(row(times, "F.linear")) + " |")


def attention(rounds: int, cases=((1, 512), (8, 512), (32, 512), (8, 64), (32, 128), (8, 1500))):
    num_blocks = 4096
    k_cache, v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    print("\n| decodes x context | per sequence ms | gathered by indexing ms | vs per sequence | engine ms "
          "| vs per sequence |\n|---|---:|---:|---:|---:|---:|")
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
        times = rounds_of({"each": each, "indexed": indexed, "engine": engine}, rounds)
        print(f"| {n} x {ctx0} | " + " | ".join(row(times, "each")) + " |")


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.bench_ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    m, facts = machine(), cpu_facts()
    print(f"{m['date']}, {m['cpu']} ({m['cpu_count']} cores; flags {', '.join(facts['cpu_flags']) or 'none read'}; "
          f"load average {facts['load_average_1min']}), torch {m['torch']}, {m['torch_threads']} thread(s); "
          f"medians of {args.rounds} rounds")
    with torch.inference_mode():
        linears(args.rounds)
        attention(args.rounds)


if __name__ == "__main__":
    main()
