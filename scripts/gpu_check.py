"""GPU check of the engine's fast path; writes one JSON file of results (docs/gpu.md).

Needs only torch, transformers (and triton on CUDA): no network, no downloads. Models are randomly
initialised at real shapes (Qwen2.5-0.5B and -1.5B configs) and built locally; the tokenizer is a
synthetic word-level one, since every request is given as token ids.

    python3 scripts/gpu_check.py --out gpu_check.json          # on a GPU, under 8 minutes
    python3 scripts/gpu_check.py --quick --out check.json       # tiny model, CPU, about a minute

Sections (each adds to the JSON as it finishes, so a run cut short still leaves its results):
  equality      greedy tokens equal transformers generate, fp32, staggered arrivals, mixed steps
  baselines     transformers generate in static batches, and transformers continuous batching
  engine        our output tokens/s on the same mixed workload
  mixed_step    model step and engine step of 32 decodes at context 1,024 + one 256-token chunk, graphs vs eager
  decode        decode step time at full batch, CUDA graphs vs eager, against the bandwidth floor
  long_prompt   p99 time between tokens with long prompts arriving: chunked vs continuous
The last lines printed are the issue's target rows, each with its value, target and PASS/FAIL.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.readers import metrics  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

SHAPES = {  # Qwen2.5 configs (architecture only; weights are random)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
FULL = dict(models=["qwen2.5-0.5b", "qwen2.5-1.5b"], vocab=151936, equality_prompts=6, equality_tokens=32,
            mixed_requests=128, prompt_range=(32, 512), output_range=(32, 256), max_num_seqs=64, budget=1024,
            decode_ctx=256, decode_steps=40, mixed_decodes=32, mixed_ctx=1024, mixed_chunk=256, mixed_steps=12,
            long_prompt=4000, long_count=6, chat_count=8, chat_tokens=240,
            long_every=30, long_budget=256, max_model_len=8192)
QUICK = dict(kv_cache_gb=0.05, models=["tiny"], vocab=1024, equality_prompts=3, equality_tokens=8, mixed_requests=8,
             prompt_range=(4, 40), output_range=(4, 16), max_num_seqs=4, budget=64, decode_ctx=16, decode_steps=5,
             mixed_decodes=3, mixed_ctx=24, mixed_chunk=16, mixed_steps=3,
             long_prompt=200, long_count=2, chat_count=3, chat_tokens=20, long_every=6, long_budget=32,
             max_model_len=512)


# ---- building blocks ----
def build_model(name: str, vocab: int, folder: Path, device: str) -> Path:
    """A random model of the given shape, saved as safetensors (bf16) with a synthetic tokenizer: byte-level,
    no merges, so every byte of text is one token (whatever tokenizer class transformers picks for the
    architecture), and a chat template that joins the messages' contents. The checks send token ids;
    the live-server check sends text."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    cfg = tf.Qwen2Config(**SHAPES[name], vocab_size=vocab, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():   # weights wider than the default init, so greedy outputs depend on context
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.5 / cfg.hidden_size ** 0.5)
    model.cpu().save_pretrained(folder)
    vocab_map = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab_map.update({f"<x{i}>": i for i in range(len(vocab_map), vocab)})
    byte_level = Tokenizer(models.BPE(vocab=vocab_map, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=byte_level)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(folder)
    del model
    free_memory()
    return folder


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pct(xs: list[float], q: float) -> float:
    """app/readers/metrics.py's percentile (the page's and the reports'); nan for no data, for the JSON."""
    v = metrics.percentile(xs, q)
    return float("nan") if v is None else v


def mixed_workload(p: dict, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(p["vocab"]) for _ in range(rng.randint(*p["prompt_range"]))],
             rng.randint(*p["output_range"])) for _ in range(p["mixed_requests"])]


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy, counting bytes read plus bytes written."""
    n = 1 << (30 if device == "cuda" else 25)
    x = torch.randn(n // 4, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * n * 10 / (time.perf_counter() - t)


def engine_for(folder: Path, p: dict, **kw) -> LLMEngine:
    kw = {"max_num_seqs": p["max_num_seqs"], "max_num_batched_tokens": p["budget"],
          "max_model_len": p["max_model_len"], "kv_cache_gb": p.get("kv_cache_gb", 1.0), **kw}
    return LLMEngine(EngineConfig(model=str(folder), **kw))


def run_engine(eng: LLMEngine, work, arrive_every: int = 0) -> tuple[float, list[str], list[dict]]:
    """All requests at once (arrive_every=0) or one every few steps. Returns wall time, ids, records."""
    pending, rids, records, step = list(work), [], [], 0
    sync()
    t = time.perf_counter()
    while pending or eng.has_unfinished():
        while pending and (arrive_every == 0 or step % arrive_every == 0):
            ids, n = pending.pop(0)
            rids.append(eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=n, ignore_eos=True)))
            if arrive_every:
                break
        records.append(eng.step().record)
        step += 1
    sync()
    return time.perf_counter() - t, rids, records


# ---- sections ----
def check_equality(folder: Path, p: dict, device: str) -> dict:
    from transformers import AutoModelForCausalLM
    rng = random.Random(1)
    prompts = [[rng.randrange(p["vocab"]) for _ in range(rng.randint(*p["prompt_range"]))]
               for _ in range(p["equality_prompts"])]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    refs = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=p["equality_tokens"],
                          min_new_tokens=p["equality_tokens"], do_sample=False, pad_token_id=0)
        refs.append(out[0, len(ids):].tolist())
    del hf
    free_memory()
    eng = engine_for(folder, p, device=device, dtype="float32", max_num_batched_tokens=64, max_model_len=1024,
                     gpu_memory_utilization=0.5)
    _, rids, _ = run_engine(eng, [(ids, p["equality_tokens"]) for ids in prompts], arrive_every=2)
    outs = [eng.get_request(r).output_token_ids for r in rids]
    first_diff = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(outs, refs)]
    res = {"prompts": len(prompts), "tokens_each": p["equality_tokens"],
           "equal": sum(o == r for o, r in zip(outs, refs)),
           "first_divergence": first_diff, "backend": eng.runner.backend.name, "cuda_graphs": bool(eng.runner.graphs)}
    del eng
    free_memory()
    return res


def hf_baselines(folder: Path, p: dict, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig
    work = mixed_workload(p)
    useful = sum(n for _, n in work)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    res = {}
    # static batches of max_num_seqs in arrival order, left-padded; a batch runs until its longest reply ends
    b = p["max_num_seqs"]
    batches = [work[i:i + b] for i in range(0, len(work), b)]

    def static(hf, batches):
        for batch in batches:
            width = max(len(ids) for ids, _ in batch)
            x = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
            n = max(m for _, m in batch)
            hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    static(hf, [[(ids[:8], 4) for ids, _ in batches[0]]])   # warm-up
    sync()
    t = time.perf_counter()
    static(hf, batches)
    sync()
    secs = time.perf_counter() - t
    res["static_generate"] = {"seconds": secs, "output_tokens_per_s": useful / secs, "batch_size": b}
    # transformers' own continuous batching (paged cache, its scheduler), one request per prompt
    try:
        gc_ = GenerationConfig(max_new_tokens=max(n for _, n in work), do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        kw = {}
        if device == "cpu":   # it sizes its cache from the machine's free memory: on a CPU, all the RAM's share
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
            kw["continuous_batching_config"] = ContinuousBatchingConfig(max_memory_percent=0.03)
        with hf.continuous_batching_context_manager(generation_config=gc_, block=True, timeout=10, **kw) as manager:
            sync()
            t = time.perf_counter()
            for i, (ids, n) in enumerate(work):
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n)
            done, produced = 0, 0
            while done < len(work):
                r = manager.get_result(timeout=60)
                if r is None:
                    raise RuntimeError(f"continuous batching stalled after {done} results")
                if r.is_finished():
                    done += 1
                    produced += len(r.generated_tokens)
            sync()
            secs = time.perf_counter() - t
        res["continuous_batching"] = {"seconds": secs, "output_tokens_per_s": produced / secs,
                                      "output_tokens": produced}
    except Exception as e:   # its API moves between transformers releases
        res["continuous_batching"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    del hf
    free_memory()
    return res


class StepTimer:
    """Times ModelRunner.run (the model step: inputs, forward, sampling; it ends on the sampled tokens'
    copy to the host) beside the engine step (the record's t_end - t_start: scheduling and bookkeeping too)."""

    def __init__(self, eng: LLMEngine):
        self.eng, self.run, self.last = eng, eng.runner.run, 0.0
        eng.runner.run = self._timed

    def _timed(self, batch):
        t = time.perf_counter()
        out = self.run(batch)
        self.last = time.perf_counter() - t
        return out

    def median_ms(self, want, n: int, graphs: bool, before_each=None) -> dict:
        """Medians over the next n steps whose record satisfies want(record), with or without graphs."""
        r = self.eng.runner
        kept, r.graphs = r.graphs, r.graphs if graphs else None
        model, engine = [], []
        try:
            for _ in range(50 * n):
                if len(model) >= n:
                    break
                if before_each:
                    before_each()
                rec = self.eng.step().record
                if want(rec):
                    model.append(self.last)
                    engine.append(rec["t_end"] - rec["t_start"])
        finally:
            r.graphs = kept
        return {"model_step_ms": pct(model, 50) * 1e3, "engine_step_ms": pct(engine, 50) * 1e3, "steps": len(model)}

    def close(self):
        self.eng.runner.run = self.run


def mixed_step(eng: LLMEngine, p: dict) -> dict:
    """32 sequences decoding at context ~1,024 while a long prompt is chunked 256 tokens a step."""
    rng = random.Random(5)
    nd, chunk = p["mixed_decodes"], p["mixed_chunk"]
    eng.set_policy("chunked", max_num_batched_tokens=nd + chunk, max_num_seqs=max(nd + 1, p["max_num_seqs"]))
    rids = [eng.add_request(prompt_token_ids=[rng.randrange(p["vocab"]) for _ in range(p["mixed_ctx"])],
                            params=SamplingParams(max_tokens=10 ** 6, ignore_eos=True)) for _ in range(nd)]
    while any(eng.get_request(x).num_output_tokens == 0 for x in rids):   # every prompt in, all decoding
        eng.step()
    long_len = chunk * (p["mixed_steps"] + 2)

    def feed():   # keep one long prompt in prefill
        if len(eng.scheduler.waiting) + len(eng.scheduler.running) <= nd:
            rids.append(eng.add_request(prompt_token_ids=[rng.randrange(p["vocab"]) for _ in range(long_len)],
                                        params=SamplingParams(max_tokens=1, ignore_eos=True)))

    def want(rec):
        kinds = [(it["kind"], it["tokens"]) for it in rec["items"]]
        return kinds.count(("decode", 1)) == nd and ("prefill", chunk) in kinds and len(kinds) == nd + 1
    timer = StepTimer(eng)
    res = {"decodes": nd, "context": p["mixed_ctx"], "chunk": chunk}
    for mode in ("graphs", "eager") if eng.runner.graphs else ("eager",):
        res[mode] = timer.median_ms(want, p["mixed_steps"], graphs=mode == "graphs", before_each=feed)
    timer.close()
    for x in rids:
        eng.abort(x)
    while eng.has_unfinished():
        eng.step()
    return res


def engine_sections(folder: Path, p: dict, device: str) -> dict:
    bw = copy_bandwidth(device)          # before the KV cache takes the memory
    free_memory()
    eng = engine_for(folder, p, device=device)
    r = eng.runner
    res = {"backend": r.backend.name, "dtype": eng.config.dtype, "kv_blocks": r.num_blocks,
           "cuda_graphs": r.graph_stats(), "weight_bytes": r.weight_bytes}
    run_engine(eng, [(ids[:16], 4) for ids, _ in mixed_workload(p, seed=9)[:4]])   # warm-up: compiles, kernels
    # mixed workload, all at once, chunked policy
    work = mixed_workload(p)
    secs, rids, records = run_engine(eng, work)
    out = sum(eng.get_request(x).num_output_tokens for x in rids)
    res["mixed"] = {"seconds": secs, "output_tokens_per_s": out / secs, "steps": len(records),
                    "policy": eng.scheduler.policy, "max_num_batched_tokens": p["budget"]}
    res["mixed_step"] = mixed_step(eng, p)
    eng.set_policy("chunked", max_num_batched_tokens=p["budget"], max_num_seqs=p["max_num_seqs"])
    # decode step at full batch: CUDA graphs, then eager
    rng = random.Random(3)
    b = p["max_num_seqs"]
    full = [([rng.randrange(p["vocab"]) for _ in range(p["decode_ctx"])], 10 ** 6) for _ in range(b)]
    rids = [eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=n, ignore_eos=True))
            for ids, n in full]
    timer, times = StepTimer(eng), {}
    full_batch = lambda rec: all(it["kind"] == "decode" for it in rec["items"]) and len(rec["items"]) == b
    for mode in ("graphs", "eager") if r.graphs else ("eager",):
        t = timer.median_ms(full_batch, p["decode_steps"], graphs=mode == "graphs")
        times[mode], times[f"{mode}_engine"] = t["model_step_ms"] / 1e3, t["engine_step_ms"] / 1e3
    timer.close()
    for x in rids:
        eng.abort(x)
    floor = r.weight_bytes / bw
    res["decode"] = {"batch": b, "context": p["decode_ctx"], "copy_bandwidth_GBps": bw / 1e9,
                     "bandwidth_floor_ms": floor * 1e3, **{f"step_ms_{k}": v * 1e3 for k, v in times.items()},
                     **{f"{k}_over_floor": times[k] / floor for k in ("graphs", "eager") if k in times}}
    # long prompts arriving among chat replies: chunked vs continuous, same arrivals by step
    rng = random.Random(4)
    chats = [([rng.randrange(p["vocab"]) for _ in range(64)], p["chat_tokens"]) for _ in range(p["chat_count"])]
    longs = [([rng.randrange(p["vocab"]) for _ in range(p["long_prompt"])], 8) for _ in range(p["long_count"])]
    res["long_prompt"] = {}
    for policy in ("chunked", "continuous"):
        eng.set_policy(policy, max_num_batched_tokens=p["long_budget"], max_num_seqs=16)
        sync()
        t = time.perf_counter()
        chat_ids = [eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=n, ignore_eos=True))
                    for ids, n in chats]
        queue, step = list(longs), 0
        while eng.has_unfinished():
            if queue and step > 0 and step % p["long_every"] == 0:
                ids, n = queue.pop(0)
                eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=n, ignore_eos=True))
            eng.step()
            step += 1
        sync()
        secs = time.perf_counter() - t
        gaps = [g for x in chat_ids for g in metrics.gaps(eng.get_request(x).token_times)]
        out = sum(eng.get_request(x).num_output_tokens for x in chat_ids) + 8 * len(longs)
        res["long_prompt"][policy] = {"seconds": secs, "output_tokens_per_s": out / secs,
                                      "tbt_p50_ms": pct(gaps, 50) * 1e3,
                                      "tbt_p99_ms": pct(gaps, 99) * 1e3, "tbt_max_ms": max(gaps) * 1e3}
    del eng
    free_memory()
    return res


def targets(m: dict) -> dict:
    """The issue's target rows (docs/gpu.md), in its order, from whatever sections finished."""
    t = {}
    base, eng = m.get("baselines", {}), m.get("engine", {})
    ours = eng.get("mixed", {}).get("output_tokens_per_s")

    def add(name, value, target, higher=True):   # every row, measured or not (value None: not measured)
        t[name] = {"value": None if value is None else round(value, 3), "target": target,
                   "pass": None if value is None else value >= target if higher else value <= target}
    graphs = eng.get("mixed_step", {}).get("graphs", {})
    add("mixed_model_step_ms (32 decodes@1024 + 256 chunk)", graphs.get("model_step_ms"), 2.0, higher=False)
    add("mixed_engine_step_ms (same batch)", graphs.get("engine_step_ms"), 3.0, higher=False)
    lp = eng.get("long_prompt", {})
    both = len(lp) == 2
    add("long_prompt_p99_tbt_continuous_over_chunked",
        lp["continuous"]["tbt_p99_ms"] / lp["chunked"]["tbt_p99_ms"] if both else None, 5.0)
    add("long_prompt_throughput_chunked_over_continuous",
        lp["chunked"]["output_tokens_per_s"] / lp["continuous"]["output_tokens_per_s"] if both else None, 0.9)
    static, cb = base.get("static_generate", {}), base.get("continuous_batching", {})
    add("vs_static_generate", ours / static["output_tokens_per_s"] if ours and static else None, 3.0)
    add("vs_transformers_continuous_batching",
        ours / cb["output_tokens_per_s"] if ours and "output_tokens_per_s" in cb else None, 2.0)
    dec = eng.get("decode", {})
    add("decode_step_ms_graphs (64 seqs@256)", dec.get("step_ms_graphs"), 1.5, higher=False)
    add("decode_graphs_over_floor", dec.get("graphs_over_floor"), 2.0, higher=False)
    eq = m.get("equality", {})
    add("fp32_greedy_prompts_equal", eq["equal"] / eq["prompts"] if "prompts" in eq else None, 1.0)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--quick", action="store_true", help="tiny model and workloads (CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", help="comma-separated subset of " + ", ".join(SHAPES))
    ap.add_argument("--deadline", type=float, default=450, help="seconds; later sections are skipped past it")
    args = ap.parse_args()
    p = QUICK if args.quick else FULL
    models = args.models.split(",") if args.models else p["models"]
    t0 = time.perf_counter()
    import transformers
    results = {"env": {"torch": torch.__version__, "transformers": transformers.__version__,
                       "python": platform.python_version(), "device": args.device,
                       "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}, "models": {}}
    try:
        import triton
        results["env"]["triton"] = triton.__version__
    except ImportError:
        pass
    out = Path(args.out)

    def save():
        results["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(results, indent=2))
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            m = results["models"][name] = {}
            folder = build_model(name, p["vocab"], Path(tmp) / name, args.device)
            dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
            sections = [("equality", lambda: check_equality(folder, p, args.device)),
                        ("baselines", lambda: hf_baselines(folder, p, args.device, dtype)),
                        ("engine", lambda: engine_sections(folder, p, args.device))]
            for key, fn in sections:
                if time.perf_counter() - t0 > args.deadline:
                    m[key] = {"skipped": "past the deadline"}
                    continue
                t = time.perf_counter()
                try:
                    m[key] = fn()
                except Exception as e:
                    m[key] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                    free_memory()
                m[key]["section_seconds"] = time.perf_counter() - t
                m["targets"] = targets(m)
                save()
                print(f"{name} {key}: {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
    save()
    for name, m in results["models"].items():
        for k, v in m.get("targets", {}).items():
            if v["value"] is None:
                print(f"{name:14s} {k:52s} {'-':>9s}  target {v['target']}  "
                      "NOT MEASURED (no CUDA graphs or section failed)")
            else:
                print(f"{name:14s} {k:52s} {v['value']:9.3f}  target {v['target']}  {'PASS' if v['pass'] else 'FAIL'}")


if __name__ == "__main__":
    main()
