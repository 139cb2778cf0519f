"""How much a weight format changes the model: int8 (or bf16) against fp32, printed side by side.

    python -m demos.compare.quality                       # int8 vs fp32, the default model
    python -m demos.compare.quality --dtypes bfloat16,int8 --json out/quality.json

Two measures, both on the engine itself:
  greedy divergence  for each of a fixed set of chat prompts, the position of the
                     first reply token where greedy decoding differs from fp32
                     (None: the first --max-tokens agree);
  perplexity         exp(mean negative log-likelihood) of a held-out text (the
                     first --ppl-tokens tokens of app/data/lighthouse_report.txt,
                     written for this project, so no model saw it in training).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.execution.attention import set_metadata
from engine.scheduling.scheduler import Batch
from engine.scheduling.sequence import Sequence

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "Give me a short recipe for pancakes.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish and German.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Why do leaves change colour in autumn?",
    "Write a Python function that reverses a string.",
    "What is the difference between weather and climate?",
    "Name four planets of the solar system.",
]
HELD_OUT = Path(__file__).parent.parent.parent / "app" / "data" / "lighthouse_report.txt"


def greedy_replies(engine: LLMEngine, max_tokens: int) -> list[list[int]]:
    outs = engine.generate(messages=[[{"role": "user", "content": p}] for p in PROMPTS],
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [o["token_ids"] for o in outs]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; None if one reply is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@torch.inference_mode()
def perplexity(engine: LLMEngine, ids: list[int]) -> float:
    """Teacher-forced: one prefill of `ids` through the engine's own runner, logits at every position."""
    runner = engine.runner
    seq = Sequence("ppl", "ppl", ids, SamplingParams(max_tokens=1), 0.0)
    if not engine.block_manager.allocate(seq, len(ids)):
        raise RuntimeError("the KV cache is too small for the perplexity text")
    try:
        step = runner.prepare(Batch(items=[(seq, len(ids))]))
        input_ids, positions, _, meta = runner.upload(step)
        set_metadata(meta)
        hidden = runner.model(input_ids, runner.cos[positions].unsqueeze(1), runner.sin[positions].unsqueeze(1))
        set_metadata(None)
        logits = runner.model.compute_logits(hidden[:-1]).float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device))
    finally:
        engine.block_manager.free(seq)
    return math.exp(nll.item())


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.compare.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="int8", help="comma list, each compared with float32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results, ref = {}, None
    for dtype in ["float32"] + [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        engine = LLMEngine(EngineConfig(model=args.model, dtype=dtype, device="cpu", kv_cache_gb=0.25))
        ids = engine.tokenize(prompt=HELD_OUT.read_text())[:args.ppl_tokens]
        ppl = perplexity(engine, ids)
        replies = greedy_replies(engine, args.max_tokens)
        ref = ref or replies
        div = [first_divergence(r, f) for r, f in zip(replies, ref)]
        results[dtype] = {"perplexity": ppl, "first_divergence": div,
                          "identical_replies": sum(d is None for d in div), "prompts": len(PROMPTS)}
        print(f"{dtype:9s} perplexity {ppl:7.3f}   first greedy divergence vs fp32 per prompt: "
              + " ".join("-" if d is None else str(d) for d in div), flush=True)
        del engine
    print(f"({len(PROMPTS)} chat prompts, up to {args.max_tokens} reply tokens; '-' = identical; "
          f"perplexity over {args.ppl_tokens} tokens of {HELD_OUT.name})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
