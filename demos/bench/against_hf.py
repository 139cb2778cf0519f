"""Benchmark: our engine against transformers, on one workload, device and dtype, in one run.

    python -m demos.bench --json out/bench.json                 # fp32, the default mixed workload
    python -m demos.bench --requests 64 --prompt-range 32,1024 --output-range 16,256 --json out/big.json
    python -m demos.bench --skip hf-static,hf-cb,decode --policies chunked --vllm-start    # beside vLLM

Parts (each can be skipped with --skip):
  workload   N requests, all arriving at t=0, prompts and reply lengths drawn
             uniformly from the given ranges (seeded; random token ids, replies
             ignore EOS so everyone produces the same tokens). Run by:
               batchscope-<policy>   our engine, each policy
               hf-static             transformers generate in static batches of
                                     --batch requests (left padding; a batch runs
                                     until its longest reply is done)
               hf-cb                 transformers' own continuous batching
                                     (init_continuous_batching), where installed
             Metrics: app.readers.metrics definitions over per-token times.
  decode     one decode step at batch 1, 8 and 32 with ~512 tokens of context:
             our engine's step (and its forward part) in each of --decode-dtypes
             (fp32, int8) against transformers' forward with a KV cache of the
             same size and, at batch 1, llama.cpp on the same GGUF file (the
             `llamacpp` extra), beside each dtype's weight-read floor (bytes a
             step reads / measured copy bandwidth; and with the KV cache too).
             The systems take turns (two steps each, the second timed), so drift
             in the machine's speed weighs on each alike; ratios are medians of
             per-round ratios.
  record     the fraction of our step time spent building the StepRecord.
  vllm       with --vllm URL or --vllm-start (demos/vllm/side.py): the workload on a vLLM server
             with batchscope's recording scheduler, on the same model (our engine then takes its
             token budget and sequence limit); its row and ours in one table.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from app.readers import metrics
from demos.bench.baselines import hf_decode_stepper, hf_has_cb, load_hf, run_hf_cb, run_hf_static
from demos.compare.runner import warm_up
from demos.compare.scenario import machine
from demos.vllm import side as vllm_side
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.weights.loader import resolve_model

POLICIES = ("static", "continuous", "chunked")


# ---- the workload ----
def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """[(prompt token ids, reply length)]; ids avoid the first 1,000 (special and byte tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = rng.randint(*prompt_range), rng.randint(*output_range)
        out.append(([rng.randrange(1000, vocab) for _ in range(p)], o))
    return out


def run_ours(engine: LLMEngine, workload, progress: bool = True) -> tuple[dict, list[dict]]:
    stream: list[dict] = []
    engine.subscribe(stream.append)
    bar = tqdm(total=sum(o for _, o in workload), desc=f"batchscope-{engine.scheduler.policy}", unit="tok",
               disable=not progress, file=sys.stderr)
    try:
        ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=o, ignore_eos=True))
               for p, o in workload]
        while not all(engine.get_request(r).is_finished for r in ids):
            rec = engine.step().record
            bar.update(sum(metrics.produces_token(i) for i in rec["items"]))
    finally:
        engine.unsubscribe(stream.append)
        bar.close()
    return metrics.summarize(stream), stream


def record_fraction(stream: list[dict]) -> dict:
    recs = [r for r in metrics.steps(stream) if "timing" in r]
    rec_s = sum(r["timing"]["record"] for r in recs)
    step_s = sum(r["t_end"] - r["t_start"] + r["timing"]["record"] for r in recs)
    fr = [r["timing"]["record"] / (r["t_end"] - r["t_start"] + r["timing"]["record"]) for r in recs]
    return {"record_s_total": rec_s, "step_s_total": step_s, "fraction": rec_s / step_s if step_s else None,
            "fraction_p99": metrics.percentile(fr, 99), "record_us_p50": (metrics.percentile(
                [r["timing"]["record"] for r in recs], 50) or 0) * 1e6}


def cpu_facts() -> dict:
    """What the CPU offers the kernels (read at run time) and how busy the machine was."""
    flags = set()
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
    return {"cpu_flags": [f for f in wanted if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load_average_1min": _loadavg()}


def _loadavg() -> float | None:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except OSError:
        return None


# ---- decode step against the bandwidth floor ----
def copy_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) copying a large buffer, best of `repeats`."""
    src = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours_decode_stepper(engine: LLMEngine, batch: int, context: int, steps: int):
    """A function that runs one decode step of `batch` sequences at ~`context` tokens and returns its
    (step, forward) seconds from the StepRecord; good for `steps` calls."""
    rng = random.Random(1)
    # the first prompts decode while the last ones prefill: replies long enough to still run when all have
    prefill_steps = -(-batch * context // engine.scheduler.token_budget)
    rids = [engine.add_request(prompt_token_ids=[rng.randrange(1000, engine.vocab_size) for _ in range(context - 1)],
                               params=SamplingParams(max_tokens=prefill_steps + steps + 3, ignore_eos=True))
            for _ in range(batch)]
    while not all(engine.get_request(r).is_prefill_done for r in rids):
        engine.step()

    def step() -> tuple[float, float]:
        out = engine.step()
        rec = out.record if out else None
        if rec is None or len(rec["items"]) != batch or any(i["kind"] != "decode" for i in rec["items"]):
            raise RuntimeError(f"a decode step did not run all {batch} sequences together (KV cache too small?)")
        return rec["t_end"] - rec["t_start"], rec["timing"]["forward"]
    return step


def kv_bytes(hf_config, batch: int, context: int, itemsize: int) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * itemsize * batch * context


def decode_part(args, cfg: dict, folder, hf, skip: set, log) -> dict:
    """Decode steps per batch size: ours per dtype, transformers, llama.cpp (batch 1), and the floors.

    The systems of one batch size take turns, two steps each per round, the second timed (the first
    wakes the system's threads while the last system's wind down; the first round is a warm-up), so a
    machine whose speed drifts over minutes weighs on each alike; a ratio is the median of the
    per-round ratios."""
    from transformers import AutoConfig

    from engine.weights.quant import int8_available
    hf_config = AutoConfig.from_pretrained(folder)
    bw, ctx, rounds = copy_bandwidth(), args.decode_context, args.decode_repeats
    dtypes = [d for d in args.decode_dtypes.split(",") if d and (d != "int8" or int8_available())]
    batches = [int(x) for x in args.decode_batches.split(",")]
    d = {"copy_bandwidth_gb_s": bw / 1e9, "context": ctx, "rounds": rounds, "interleaved": True,
         "batches": {str(b): {"ours": {}} for b in batches}}
    llama = None
    if "llamacpp" not in skip and args.model is None:
        try:
            import llama_cpp

            from demos.bench.baselines import llamacpp_decode_stepper
            from engine.weights.loader import default_gguf
            d["llamacpp_version"] = llama_cpp.__version__
            llama = lambda: llamacpp_decode_stepper(default_gguf(), ctx, 2 * (rounds + 1), hf_config.vocab_size,
                                                   torch.get_num_threads())
        except ImportError:
            d["llamacpp_error"] = "llama-cpp-python is not installed (pip install 'batchscope[llamacpp]')"
    for b in batches:
        r, systems, engines = d["batches"][str(b)], {}, {}
        for dtype in dtypes:
            engines[dtype] = LLMEngine(EngineConfig(**{**cfg, "dtype": dtype, "max_num_seqs": max(b, args.batch),
                                                       "max_num_batched_tokens": max(args.budget, 2048)},
                                                    policy="chunked"))
            warm_up(engines[dtype])
            systems[dtype] = ours_decode_stepper(engines[dtype], b, ctx, 2 * (rounds + 1))
        if hf is not None:
            hf_step = hf_decode_stepper(hf, b, ctx, hf_config.vocab_size)
            systems["hf"] = lambda f=hf_step: (f(), None)
        if b == 1 and llama is not None:
            ll_step = llama()
            systems["llamacpp"] = lambda f=ll_step: (f(), None)
        times = {k: [] for k in systems}
        for _ in range(rounds + 1):
            for k, f in systems.items():
                f()                         # untimed: wakes this system's threads, waits out the last one's
                times[k].append(f())
        step = {k: [t[0] for t in v[1:]] for k, v in times.items()}     # round 0 was the warm-up
        for dtype, engine in engines.items():
            floor = engine.runner.weight_bytes / bw * 1e3
            kvb = kv_bytes(hf_config, b, ctx, engine.runner.dtype.itemsize)
            r["ours"][dtype] = {
                "step_ms": statistics.median(step[dtype]) * 1e3,
                "forward_ms": statistics.median(t[1] for t in times[dtype][1:]) * 1e3,
                "weight_bytes": engine.runner.weight_bytes, "weight_floor_ms": floor,
                "weight_plus_kv_floor_ms": floor + kvb / bw * 1e3,
                "step_over_floor": statistics.median(step[dtype]) * 1e3 / floor}
            if "hf" in step:
                r["ours"][dtype]["hf_over_ours"] = statistics.median(h / o for h, o in zip(step["hf"], step[dtype]))
        if "hf" in step:
            r["hf_forward_ms"] = statistics.median(step["hf"]) * 1e3
        if "llamacpp" in step:
            d["llamacpp_batch1_step_ms"] = statistics.median(step["llamacpp"]) * 1e3
            d["ours_over_llamacpp_batch1"] = {k: statistics.median(o / l for o, l in zip(step[k], step["llamacpp"]))
                                              for k in engines}
        if b == 1 and {"float32", "int8"} <= set(step):
            d["int8_speedup_batch1"] = statistics.median(f / i for f, i in zip(step["float32"], step["int8"]))
        del engines, systems
        log(f"decode batch {b} done")
    return d


# ---- the run, and its report ----
def ratio(a, b):
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="out/bench.json")
    ap.add_argument("--model", default=None, help="local model folder or Hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16: both sides use it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-range", default="32,512")
    ap.add_argument("--output-range", default="16,128")
    ap.add_argument("--batch", type=int, default=16, help="max sequences per step (ours, hf-cb), hf-static batch size")
    ap.add_argument("--budget", type=int, default=512, help="token budget per step (ours, hf-cb)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--decode-batches", default="1,8,32")
    ap.add_argument("--decode-dtypes", default="float32,int8", help="our dtypes in the decode part")
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--skip", default="", help="comma list of: ours, hf-static, hf-cb, decode, llamacpp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", default=None, help="also write the tables as markdown here")
    ap.add_argument("--quiet", action="store_true")
    vllm_side.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    progress = not args.quiet
    prange = tuple(int(x) for x in args.prompt_range.split(","))
    orange = tuple(int(x) for x in args.output_range.split(","))
    vllm = vllm_side.named(args)
    if vllm is not None:                # ours take vLLM's budgets: one schedule shape on both sides
        args.budget, args.batch = vllm.settings["max_num_batched_tokens"], vllm.settings["max_num_seqs"]
        args.dtype = vllm.dtype
        print(f"{vllm.name}: budget {args.budget}, max_num_seqs {args.batch} (batchscope's engine runs with the same)",
              file=sys.stderr)
    cfg = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch,
               max_num_batched_tokens=args.budget)
    probe = LLMEngine(EngineConfig(**cfg, num_kv_blocks=64))
    workload = make_workload(args.requests, prange, orange, probe.vocab_size, args.seed)
    folder = resolve_model(args.model)
    out = {"machine": {**machine(), **cpu_facts()}, "model": probe.model_name, "dtype": args.dtype,
           "device": probe.device, "weight_bytes": probe.runner.weight_bytes,
           "workload": {"requests": args.requests, "prompt_range": prange, "output_range": orange,
                        "prompt_tokens": sum(len(p) for p, _ in workload),
                        "output_tokens": sum(o for _, o in workload), "seed": args.seed, "arrivals": "all at t=0",
                        "batch": args.batch, "token_budget": args.budget},
           "systems": {}, "ratios": {}}
    del probe
    t_all = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_all:6.0f}s] {msg}", file=sys.stderr, flush=True)

    streams = {}
    if "ours" not in skip:
        for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
            engine = LLMEngine(EngineConfig(**cfg, policy=policy))
            warm_up(engine, max(len(p) for p, _ in workload))
            out["systems"][f"batchscope-{policy}"], streams[policy] = run_ours(engine, workload, progress)
            del engine
            log(f"batchscope-{policy} done")
    hf = None
    if not {"hf-static", "hf-cb", "decode"} <= skip:
        hf = load_hf(folder, EngineConfig(dtype=args.dtype).torch_dtype, args.device)
        tok_pad = hf.generation_config.pad_token_id
        pad = tok_pad if isinstance(tok_pad, int) else 0
        run_hf_static(hf, [(workload[0][0][:64], 2)], 1, pad, progress=False)      # warm-up
    if "hf-static" not in skip:
        out["systems"]["hf-static"] = run_hf_static(hf, workload, args.batch, pad, progress)
        log("hf-static done")
    if "hf-cb" not in skip:
        if hf_has_cb(hf):
            try:
                out["systems"]["hf-cb"] = run_hf_cb(hf, workload, args.batch, args.budget, progress)
            except Exception as e:          # report, do not lose the rest of the run
                out["systems"]["hf-cb"] = {"error": f"{type(e).__name__}: {e}"}
        else:
            out["systems"]["hf-cb"] = {"error": "this transformers has no init_continuous_batching"}
        log("hf-cb done")
    for name, s in out["systems"].items():
        if name.startswith("batchscope") and "output_tokens_per_s" in s:
            out["ratios"][name] = {
                f"output_tokens_per_s_vs_{b}": ratio(s["output_tokens_per_s"],
                                                     out["systems"][b].get("output_tokens_per_s"))
                for b in ("hf-static", "hf-cb") if b in out["systems"]}
            for b in ("hf-static", "hf-cb"):
                if b in out["systems"]:
                    for k in ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s"):
                        out["ratios"][name][f"{k}_{b}_over_ours"] = ratio(out["systems"][b].get(k), s[k])
    if streams:
        out["record"] = {p: record_fraction(st) for p, st in streams.items()}
    with vllm_side.serving(args, vllm, args.model, args.budget, args.batch, dtype=args.dtype) as vllm:
        if vllm is not None:
            out["systems"][vllm.name], _ = vllm_side.run_workload(vllm, workload)
            out["vllm"] = {"engine": vllm.hello.get("engine"), "device": vllm.hello.get("device"),
                           "settings": vllm.settings}
            log(f"{vllm.name} done")

    if "decode" not in skip:
        out["decode"] = decode_part(args, cfg, folder, hf, skip, log)
    out["wall_s"] = time.perf_counter() - t_all
    out["machine"]["load_average_1min_at_end"] = _loadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print_summary(out)
    if "vllm" in out:
        print(vllm_side.table([(k, s) for k, s in out["systems"].items() if "error" not in s]))
    print(f"wrote {args.json}")
    if args.md:
        Path(args.md).write_text(markdown(out))
        print(f"wrote {args.md}")


def markdown(out: dict) -> str:
    """The run as markdown tables (docs/results.md is pasted from this)."""
    m = out["machine"]
    w = out["workload"]
    lines = [f"Measured {m['date']} on {m['cpu']} ({m['cpu_count']} cores, {m['torch_threads']} torch thread(s); "
             f"flags {', '.join(m.get('cpu_flags', [])) or '?'}; torch kernels {m.get('torch_cpu_capability', '?')}; "
             f"load average {m.get('load_average_1min')} at start, {m.get('load_average_1min_at_end')} at end), "
             f"torch {m['torch']}, transformers {m.get('transformers', '?')}; {out['model']}, {out['dtype']}, "
             f"{out['device']}. Workload: {w['requests']} requests at t=0, prompts {w['prompt_range'][0]}-"
             f"{w['prompt_range'][1]} tokens ({w['prompt_tokens']} in all), replies {w['output_range'][0]}-"
             f"{w['output_range'][1]} tokens ({w['output_tokens']} in all), seed {w['seed']}; {w['batch']} "
             f"sequences per step, token budget {w['token_budget']}.", "",
             "| system | output tok/s | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TBT p99 ms | tok/s vs hf-static "
             "| tok/s vs hf-cb |", "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, scale=1e3, nd=0):
        return "–" if v is None else f"{v * scale:,.{nd}f}"
    for name, s in out["systems"].items():
        if "error" in s:
            lines.append(f"| {name} | error: {s['error']} |||||||")
            continue
        r = out["ratios"].get(name, {})
        lines.append(f"| {name} | {f(s['output_tokens_per_s'], 1, 1)} | {f(s['ttft_p50_s'])} | {f(s['ttft_p99_s'])} "
                     f"| {f(s['tbt_p50_s'], nd=1)} | {f(s['tbt_p99_s'], nd=1)} "
                     f"| {f(r.get('output_tokens_per_s_vs_hf-static'), 1, 2)} "
                     f"| {f(r.get('output_tokens_per_s_vs_hf-cb'), 1, 2)} |")
    d = out.get("decode")
    if d:
        lines += ["", f"Decode step at ~{d['context']} tokens of context; copy bandwidth "
                      f"{d['copy_bandwidth_gb_s']:.1f} GB/s (read + write); floor = weight bytes a step reads / "
                      f"bandwidth. The systems of a batch size take turns, two steps each (the second timed), for "
                      f"{d.get('rounds')} rounds after a warm-up round; step times are medians, ratios medians "
                      "of the per-round ratios.", "", *decode_lines(d)]
    if out.get("record"):
        lines += ["", "| policy | StepRecord building, share of step time | per step, p50 |", "|---|---:|---:|"]
        for p, r in out["record"].items():
            lines.append(f"| {p} | {r['fraction'] * 100:.3f}% | {r['record_us_p50']:.0f} µs |")
    return "\n".join(lines) + "\n"


def print_summary(out: dict, file=None):
    file = file or sys.stdout          # the stdout of the moment: a default bound at import goes stale
    def f(v, scale=1e3):
        return "–" if v is None else f"{v * scale:,.1f}"
    print(f"{'system':24}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TBT p50':>10}{'TBT p99':>10}  (ms)", file=file)
    for name, s in out["systems"].items():
        if "error" in s:
            print(f"{name:24}  error: {s['error']}", file=file)
            continue
        print(f"{name:24}{f(s['output_tokens_per_s'], 1):>10}{f(s['ttft_p50_s']):>10}{f(s['ttft_p99_s']):>10}"
              f"{f(s['tbt_p50_s']):>10}{f(s['tbt_p99_s']):>10}", file=file)
    for name, r in out.get("ratios", {}).items():
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items() if v is not None), file=file)
    for p, r in out.get("record", {}).items():
        print(f"record building, {p}: {r['fraction'] * 100:.3f}% of step time (p50 {r['record_us_p50']:.0f} us)",
              file=file)
    d = out.get("decode")
    if d:
        print(f"copy bandwidth {d['copy_bandwidth_gb_s']:.1f} GB/s, context {d['context']}", file=file)
        print("\n".join(decode_lines(d)), file=file)


def decode_lines(d: dict) -> list[str]:
    """The decode part as a markdown table, and its headline ratios."""
    lines = ["| batch | dtype | step ms | forward ms | floor ms (weights) | step / floor | floor ms (+KV) "
             "| transformers fp32 forward ms | transformers / ours |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b, r in d["batches"].items():
        for dtype, o in r["ours"].items():
            lines.append(f"| {b} | {dtype} | {o['step_ms']:.1f} | {o['forward_ms']:.1f} | {o['weight_floor_ms']:.1f} "
                         f"| {o['step_over_floor']:.2f} | {o['weight_plus_kv_floor_ms']:.1f} "
                         f"| {r.get('hf_forward_ms', float('nan')):.1f} | {o.get('hf_over_ours', float('nan')):.2f} |")
    if "llamacpp_batch1_step_ms" in d:
        lines.append(f"| 1 | llama.cpp {d.get('llamacpp_version', '')} (GGUF Q4_1) "
                     f"| {d['llamacpp_batch1_step_ms']:.1f} | | | | | | |")
    lines.append("")
    if "int8_speedup_batch1" in d:
        lines.append(f"int8 / fp32 batch-1 step speed-up: {d['int8_speedup_batch1']:.2f}x")
    for k, v in d.get("ours_over_llamacpp_batch1", {}).items():
        lines.append(f"ours ({k}) / llama.cpp batch-1 step time: {v:.2f}x")
    if "llamacpp_error" in d:
        lines.append(f"llama.cpp: {d['llamacpp_error']}")
    return lines


if __name__ == "__main__":
    main()
