"""Record a step-cost trace on a GPU: the page's cost model drawn for a machine where decodes ride free.

    python3 scripts/gpu_cost_trace.py --out gpu_cost_trace.json        # on a GPU, about a minute
    python3 scripts/gpu_cost_trace.py --quick --out /tmp/t.json         # CPU smoke run, tiny model

The model has the default model's shapes (SmolLM2-135M: 30 layers, hidden 576,
vocabulary 49,152) with random weights in bf16, built locally: a GPU machine
without the weights can still record it, and a step's time does not depend on
the values of the weights, only on their shapes. The engine runs the chunked
policy through three phases, so that the fit sees every step shape:

  decode     n running replies and nothing else, n = 1, 2, 4 ... 128
  prefill    one long prompt alone, in chunks of 32 ... 2,048 tokens
  mixed      32 running replies sharing each step with a long prompt's chunks

The output is a trace like the ones the app saves (a `trace` header, then
request events, policy events and step records), without the KV map fields,
which the cost model does not read. It imports engine/ and app.readers.analysis (pure Python), not the web stack.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.readers.analysis import fit_stream, regime  # noqa: E402  (pure Python: no web stack)
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
               tie_word_embeddings=True, rope_theta=100000.0)
TINY = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024)
FULL = dict(shape=SMOLLM2, decodes=(1, 2, 4, 8, 16, 32, 64, 128), chunks=(32, 128, 512, 2048), long_prompt=4096,
            mixed_decodes=32, mixed_budgets=(128, 256, 512, 1024), steps_each=6, budget=512, max_num_seqs=128,
            kv_cache_gb=2.0)
QUICK = dict(shape=TINY, decodes=(1, 4), chunks=(16, 64), long_prompt=200, mixed_decodes=4, mixed_budgets=(32,),
             steps_each=2, budget=64, max_num_seqs=8, kv_cache_gb=0.05)
DROP = ("kv_ops", "kv_map")     # block-level fields: large, and the cost model does not read them


def build_model(shape: dict, folder: Path, dtype: torch.dtype) -> Path:
    """A Llama model of the given shapes with random weights, and a word-level tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, models
    cfg = tf.LlamaConfig(**shape, eos_token_id=None, bos_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tf.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(folder)
    return folder


def record(folder: Path, p: dict, device: str) -> tuple[LLMEngine, list[dict]]:
    dtype = "bfloat16" if device == "cuda" else "float32"
    eng = LLMEngine(EngineConfig(model=str(folder), device=device, dtype=dtype, policy="chunked",
                                 max_num_batched_tokens=p["budget"], max_num_seqs=p["max_num_seqs"],
                                 max_model_len=p["long_prompt"] + 256, kv_cache_gb=p["kv_cache_gb"]))
    rng = random.Random(0)
    vocab = p["shape"]["vocab_size"]
    prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]
    endless = SamplingParams(max_tokens=10 ** 6, ignore_eos=True)

    def add(n_tokens: int) -> str:
        return eng.add_request(prompt_token_ids=prompt(n_tokens), params=endless)

    def run(steps: int, until_decode_only: list[str] | None = None):
        if until_decode_only:   # first let every prompt be prefilled
            while any(not eng.get_request(r).is_prefill_done for r in until_decode_only):
                eng.step()
        for _ in range(steps):
            eng.step()

    def clear():
        for r in list(eng.requests):
            eng.abort(r)

    # warm-up, unrecorded: kernels, CUDA graphs, allocator
    run(4, [add(64) for _ in range(4)])
    clear()
    stream: list[dict] = []
    eng.subscribe(stream.append)
    for n in p["decodes"]:
        run(p["steps_each"], [add(32) for _ in range(n)])
        clear()
    for chunk in p["chunks"]:
        eng.set_policy(max_num_batched_tokens=chunk)
        add(min(p["long_prompt"], chunk * p["steps_each"]))
        run(p["steps_each"])
        clear()
    for budget in p["mixed_budgets"]:
        eng.set_policy(max_num_batched_tokens=max(p["budget"], p["mixed_decodes"]))
        run(0, [add(32) for _ in range(p["mixed_decodes"])])
        eng.set_policy(max_num_batched_tokens=budget)
        add(p["long_prompt"])
        run(p["steps_each"])
        clear()
    eng.set_policy(max_num_batched_tokens=p["budget"])
    eng.unsubscribe(stream.append)
    return eng, [{k: v for k, v in o.items() if k not in DROP} for o in stream]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_cost_trace.json")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    p = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(p["shape"], Path(tmp) / "model",
                             torch.bfloat16 if args.device == "cuda" else torch.float32)
        eng, stream = record(folder, p, args.device)
    s = eng.stats()
    import transformers
    meta = {"type": "trace", "version": 1, "model": "SmolLM2-135M shapes, random weights" if not args.quick else "tiny",
            "device": s["device"], "dtype": s["dtype"], "attention_backend": s["attention_backend"],
            "policy": s["policy"], "max_num_batched_tokens": s["max_num_batched_tokens"],
            "max_num_seqs": s["max_num_seqs"], "max_prefill_chunk": s["max_prefill_chunk"],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "scenario": "gpu-cost-sweep", "clock": "step",
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "cuda_graphs": bool(eng.runner.graphs), "torch": torch.__version__,
            "transformers": transformers.__version__}
    Path(args.out).write_text(json.dumps([meta] + stream, separators=(",", ":")))
    steps = [o for o in stream if o.get("type") == "step"]
    for fit in fit_stream(stream):
        print(f"{fit.device}: {len(steps)} steps, time = {fit.a * 1e3:.2f} ms + {fit.b * 1e6:.2f} us/token "
              f"+ {fit.c * 1e9:.2f} ns/context token, R2 {fit.r2}, regime at budget {p['budget']}: "
              f"{regime(fit, p['budget'])}")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
