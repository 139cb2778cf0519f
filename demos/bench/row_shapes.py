"""oneDNN's linears fed every row count a flat batch can have: resident memory and time, exact rows against
the padded rows engine.models.fast_paths.packed_linear hands it, side by side.

    python -m demos.bench.row_shapes [--max-rows 512] [--rounds 3]

memory   two child processes, one per variant, each passing every row count from 1 to --max-rows, in a
         random order, through the default model's four layer linears (and its head at up to 64 rows,
         the sampled rows of a step) in oneDNN's layout, --rounds times; resident memory after each round
time     one process, both variants taking turns at a few row counts: the padding's cost

Shapes are SmolLM2-135M's; the weights are random (time and memory do not depend on the values).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch

from demos.bench.against_hf import cpu_facts
from demos.compare.scenario import machine
from engine.execution.model_runner import keep_freed_memory
from engine.models import fast_paths

SHAPES = ((3 * 576, 576), (576, 576), (2 * 1536, 576), (576, 1536))   # qkv, o, gate_up, down
HEAD = (49152, 576)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def variant(name: str):
    exact = lambda x, p: fast_paths._onednn(x, p, None)            # noqa: E731
    return exact if name == "exact" else fast_paths.packed_linear


def child(name: str, max_rows: int, rounds: int, seed: int):
    """Every row count through the layer shapes, rounds times: one JSON line of resident MB per round."""
    keep_freed_memory()                             # as the engine's runner does on a CPU
    run = variant(name)
    weights = [fast_paths.pack(torch.randn(*s) * 0.02) for s in SHAPES]
    head = fast_paths.pack(torch.randn(*HEAD) * 0.02)
    out, rng = {"start": rss_mb(), "rounds": []}, random.Random(seed)
    for _ in range(rounds):
        order = list(range(1, max_rows + 1))
        rng.shuffle(order)
        for rows in order:
            for (_, inp), w in zip(SHAPES, weights):
                run(torch.randn(rows, inp), w)
            if rows <= 64:
                run(torch.randn(rows, HEAD[1]), head)
        out["rounds"].append(rss_mb())
    print(json.dumps(out))


def timing(rows_list: list[int], reps: int) -> list[tuple[int, int, float, float]]:
    """(rows, padded rows, exact ms, padded ms) per row count: medians, the variants taking turns (the
    first repetition of each is its warm-up)."""
    weights = [fast_paths.pack(torch.randn(*s) * 0.02) for s in SHAPES]
    out = []
    for rows in rows_list:
        xs = [torch.randn(rows, inp) for _, inp in SHAPES]
        times: dict[str, list[float]] = {"exact": [], "padded": []}
        for _ in range(reps):
            for name in times:
                run = variant(name)
                t0 = time.perf_counter()
                for x, w in zip(xs, weights):
                    run(x, w)
                times[name].append((time.perf_counter() - t0) * 1e3)
        out.append((rows, fast_paths.padded_rows(rows), statistics.median(times["exact"][1:]),
                    statistics.median(times["padded"][1:])))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m demos.bench.row_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-rows", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=9, help="timed repetitions per row count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=("exact", "padded"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.max_rows, args.rounds, args.seed)
    if not fast_paths.packed_weights_work(torch.float32):
        sys.exit("this torch has no oneDNN fp32 linear: nothing to measure")
    m, facts = machine(), cpu_facts()
    print(f"{m['date']}, {m['cpu']} ({m['cpu_count']} cores; flags {', '.join(facts['cpu_flags']) or 'none read'}; "
          f"load average {facts['load_average_1min']}), torch {m['torch']}, {m['torch_threads']} thread(s)")
    keep_freed_memory()
    results = {}
    for name in ("exact", "padded"):
        cmd = [sys.executable, "-m", "demos.bench.row_shapes", "--child", name, "--max-rows", str(args.max_rows),
               "--rounds", str(args.rounds), "--seed", str(args.seed)]
        results[name] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    sizes = len({fast_paths.padded_rows(r) for r in range(1, args.max_rows + 1)})
    print(f"\nresident MB, every row count 1..{args.max_rows} per round "
          f"(exact: {args.max_rows} shapes per linear; padded: {sizes})\n")
    print("| variant | start | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " |")
    print("|---|---:|" + "---:|" * args.rounds)
    for name, r in results.items():
        print(f"| {name} | {r['start']:.0f} | " + " | ".join(f"{m:.0f}" for m in r["rounds"]) + " |")
    print("\nms for the four layer linears, medians of", args.reps - 1, "(the variants taking turns)\n")
    print("| rows | padded to | exact ms | padded ms | padded / exact |")
    print("|---:|---:|---:|---:|---:|")
    for rows, padded, exact, pad in timing([1, 16, 17, 100, 257, 1000, 2047], args.reps):
        print(f"| {rows} | {padded} | {exact:.2f} | {pad:.2f} | {pad / exact:.2f} |")


if __name__ == "__main__":
    main()
