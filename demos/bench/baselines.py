"""transformers and llama.cpp baselines for demos.bench, timed per token and measured with app.readers.metrics.

    load_hf(folder, dtype, device)                   the reference model, SDPA attention
    run_hf_static(model, workload, batch, pad_id)    generate() in static batches
    run_hf_cb(model, workload, batch, budget)        transformers' own continuous batching
    hf_decode_stepper(model, batch, context, ...)    times one decode forward over a KV cache, per call
    llamacpp_decode_stepper(gguf, context, ...)      llama.cpp (llama-cpp-python, the `llamacpp` extra):
                                                     times one single-stream decode step on the GGUF file

workload: [(prompt token ids, reply length)], everyone arriving at t=0.
"""
from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from app.readers import metrics


class _TimeStreamer:
    """A generate() streamer that notes when each new token column arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.first = True

    def put(self, value):
        if self.first:          # generate() first hands over the prompt
            self.first = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def load_hf(folder, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device)
    return m.eval().requires_grad_(False)


@torch.inference_mode()
def run_hf_static(model, workload, batch: int, pad_id: int, progress: bool = True) -> dict:
    dev = model.device
    t0 = time.perf_counter()
    times: dict[str, list[float]] = {}
    bar = tqdm(total=sum(o for _, o in workload), desc="hf-static", unit="tok", disable=not progress, file=sys.stderr)
    for b0 in range(0, len(workload), batch):
        group = workload[b0:b0 + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in group], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=dev)
        n = max(o for _, o in group)
        st = _TimeStreamer()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=pad_id, streamer=st)
        for i, (_, o) in enumerate(group):
            times[str(b0 + i)] = st.times[:o]     # a request's reply is its first o tokens; the rest is waste
        bar.update(sum(o for _, o in group))
    bar.close()
    s = metrics.latency_summary({str(i): t0 for i in range(len(workload))}, times)
    s["generated_tokens_incl_padding_waste"] = sum(
        len(workload[b0:b0 + batch]) * max(o for _, o in workload[b0:b0 + batch])
        for b0 in range(0, len(workload), batch))
    return s


@torch.inference_mode()
def run_hf_cb(model, workload, batch: int, budget: int, progress: bool = True) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    page = 256
    blocks = sum(-(-(len(p) + o) // page) for p, o in workload) + 8     # room for everyone: no preemption
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=budget,
                                   max_requests_per_batch=batch)
    gc = GenerationConfig(max_new_tokens=max(o for _, o in workload), do_sample=False, eos_token_id=-1)
    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    bar = tqdm(total=len(workload), desc="hf-cb", unit="req", disable=not progress, file=sys.stderr)
    try:
        t0 = time.perf_counter()
        rids = [mgr.add_request(p, max_new_tokens=o, record_timestamps=True, eos_token_id=-1) for p, o in workload]
        results = {}
        while len(results) < len(rids):
            r = mgr.get_result(timeout=120)
            if r is None:
                raise RuntimeError("transformers continuous batching stopped answering")
            if r.is_finished():
                if r.error:
                    raise RuntimeError(f"transformers continuous batching failed a request: {r.error}")
                results[r.request_id] = r
                bar.update(1)
    finally:
        bar.close()
        mgr.stop(block=True)
    times = {rid: list(results[rid].timestamps or []) for rid in rids}
    bad = [rid for (p, o), rid in zip(workload, rids) if len(times[rid]) != o]
    if bad:
        raise RuntimeError(f"transformers continuous batching returned wrong lengths for {bad[:3]}")
    return metrics.latency_summary({rid: t0 for rid in rids}, times)


def hf_has_cb(model) -> bool:
    return hasattr(model, "init_continuous_batching")


@torch.inference_mode()
def hf_decode_stepper(model, batch: int, context: int, vocab: int):
    """A function that times (seconds) transformers' forward for one new token per row over a KV cache
    of context - 1 tokens, the same step each call.

    The cache is one prefill repeated along the batch (distinct memory per row,
    same values): a decode step's cost does not depend on the values, and this
    saves prefilling batch x context tokens.
    """
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, vocab, (1, context - 1), generator=g).to(model.device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    for layer in cache.layers:
        layer.batch_repeat_interleave(batch)
    assert cache.layers[0].keys.shape[0] == batch and cache.get_seq_length() == context - 1
    nxt = torch.randint(1000, vocab, (batch, 1), generator=g).to(model.device)
    pos = torch.full((batch, 1), context - 1, device=model.device)

    def step() -> float:
        t = time.perf_counter()
        model(input_ids=nxt, cache=cache, use_cache=True, position_ids=pos)
        dt = time.perf_counter() - t
        cache.crop(-1)                      # back to context - 1 tokens
        return dt
    return step


def llamacpp_decode_stepper(gguf, context: int, steps: int, vocab: int, threads: int):
    """A function that times (seconds) llama.cpp evaluating one new token, single stream, after a
    prompt of context - 1 tokens; good for `steps` calls (llama-cpp-python's Llama has one sequence;
    its parallel slots live in llama-server)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf), n_ctx=context + steps + 8, n_threads=threads, n_batch=512, verbose=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, vocab, (context - 1 + steps,), generator=g).tolist()
    llm.eval(ids[:context - 1])
    rest = iter(ids[context - 1:])

    def step() -> float:
        tok = next(rest)
        t = time.perf_counter()
        llm.eval([tok])
        return time.perf_counter() - t
    return step
