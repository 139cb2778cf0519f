"""Randomised stress of the whole engine on a tiny model: arrivals, aborts, policy and budget
switches and a cache small enough to force preemption. Nothing may be lost or corrupted."""
import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import hf_greedy, save_tiny_model

MAX_NEW = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(3, 90))] for _ in range(12)]
    refs = [hf_greedy(ref_model, p, MAX_NEW, eos=False) for p in prompts]
    return folder, prompts, refs


def check_step(rec):
    assert not rec["failed"], f"step {rec['step']} failed: {rec.get('error')}"
    kinds = [it["kind"] for it in rec["items"]]
    assert kinds == sorted(kinds), f"step {rec['step']}: decodes must come first, got {kinds}"
    if rec["policy"] == "chunked":
        assert rec["num_tokens"] <= rec["token_budget"]
        decodes = sum(1 for it in rec["items"] if it["kind"] == "decode")
        room = len(rec["items"]) < rec["max_num_seqs"] and decodes < rec["token_budget"]
        assert not (rec["stalled"] and room), f"step {rec['step']} left out decodes {rec['stalled']}"
    else:   # whole prompts: only a lone prompt may exceed the budget
        assert rec["num_tokens"] <= rec["token_budget"] or len(rec["items"]) == 1
    assert len(rec["items"]) <= rec["max_num_seqs"]
    assert rec["num_tokens"] == sum(it["tokens"] for it in rec["items"])


@pytest.mark.parametrize("seed, block_size", [(1, 4), (2, 2)])
def test_random_workload_loses_nothing(tiny, seed, block_size):
    """Small blocks (a cache of 320 tokens either way), so that a preempted request comes back through
    the prefix cache, often with all but its newest token cached: a decode at admission."""
    folder, prompts, refs = tiny
    eng = LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=block_size,
                                 num_kv_blocks=320 // block_size, max_num_batched_tokens=32, max_num_seqs=6))
    rng = random.Random(seed)
    expected, aborted, preempted = {}, set(), 0
    back_from_cache, was_preempted = 0, set()   # re-admissions served by the prefix cache
    submitted, steps = 0, 0
    while submitted < 150 or eng.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if submitted < 150:
                i, m = rng.randrange(len(prompts)), rng.randint(1, MAX_NEW)
                rid = eng.add_request(prompt_token_ids=prompts[i], label=f"u{i}",
                                      params=SamplingParams(max_tokens=m, ignore_eos=True))
                expected[rid] = refs[i][:m]
                submitted += 1
        if eng.requests and rng.random() < 0.05:
            rid = rng.choice(list(eng.requests))
            assert eng.abort(rid, "test")
            aborted.add(rid)
        if rng.random() < 0.05:
            eng.set_policy(rng.choice(["static", "continuous", "chunked"]),
                           max_num_batched_tokens=rng.choice([4, 8, 16, 64, 256]),
                           max_num_seqs=rng.randint(1, 8), max_prefill_chunk=rng.choice([None, 8]))
        out = eng.step()
        rec = out.record if out else None
        if rec:
            check_step(rec)
            preempted += len(rec["preempted"])
            for it in rec["items"]:
                if it["req"] in was_preempted and it["req"] not in rec["preempted"]:
                    back_from_cache += it["kind"] == "decode" or bool(it.get("cached"))
                    was_preempted.discard(it["req"])
            was_preempted.update(rec["preempted"])
        steps += 1
        assert steps < 20000
    assert preempted > 0, "the cache was meant to be small enough to force preemption"
    assert back_from_cache > 0, "no preempted request came back through the prefix cache"
    for rid, ref in expected.items():
        seq = eng.get_request(rid)
        if rid in aborted:
            assert seq.finish_reason == "abort"
        else:
            assert seq.output_token_ids == ref, f"{rid} ({seq.label}) diverged after {seq.num_preemptions} preemptions"
    assert eng.block_manager.num_used == 0
    assert not eng.scheduler.running and not eng.scheduler.waiting
