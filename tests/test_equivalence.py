"""Greedy output equals transformers generate, token for token, under every policy and budget."""
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import CHAT_PROMPTS, hf_greedy, save_tiny_model

MAX_NEW = 24


@pytest.fixture(scope="module")
def references(default_engine_fp32, hf_default_model):
    eng = default_engine_fp32
    prompts = [eng.tokenize(messages=[{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return [(ids, hf_greedy(hf_default_model, ids, MAX_NEW)) for ids in prompts]


def run_staggered(eng, prompts, max_tokens, gap_steps=2):
    """Requests arrive at different steps while others are mid-prefill or decoding."""
    pending, rids = list(prompts), []
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % gap_steps == 0:
            rids.append(eng.add_request(prompt_token_ids=pending.pop(0), params=SamplingParams(max_tokens=max_tokens)))
        eng.step()
        step += 1
    return [eng.get_request(r).output_token_ids for r in rids]


@pytest.mark.model
@pytest.mark.parametrize("policy", ["static", "continuous", "chunked"])
@pytest.mark.parametrize("budget", [8, 64, 512])
def test_default_model_matches_transformers(default_engine_fp32, references, policy, budget):
    eng = default_engine_fp32
    eng.set_policy(policy, max_num_batched_tokens=budget, max_num_seqs=4)
    outs = run_staggered(eng, [ids for ids, _ in references], MAX_NEW)
    for (ids, ref), out in zip(references, outs):
        assert out == ref, f"{policy}/{budget}: prompt of {len(ids)} tokens diverged"
    assert eng.block_manager.num_used == 0


@pytest.mark.model
def test_capital_of_france(default_engine_fp32):
    out = default_engine_fp32.generate(messages=[[{"role": "user", "content": "What is the capital of France?"}]],
                                       params=SamplingParams(max_tokens=30))
    assert out[0]["text"] == "The capital of France is Paris."
    assert out[0]["finish_reason"] == "stop"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "llama-tied-scaled"])
def test_tiny_models_match_transformers(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM
    folder = save_tiny_model(arch, tmp_path / arch)
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 77, 130)]
    refs = [hf_greedy(ref_model, p, 12, eos=False) for p in prompts]
    for policy, budget in [("chunked", 16), ("continuous", 64), ("static", 32)]:
        eng = LLMEngine(EngineConfig(model=str(folder), dtype="float32", policy=policy,
                                     max_num_batched_tokens=budget, block_size=8, num_kv_blocks=128))
        rids = [eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=12, ignore_eos=True))
                for p in prompts]
        while eng.has_unfinished():
            eng.step()
        for p, ref, r in zip(prompts, refs, rids):
            assert eng.get_request(r).output_token_ids == ref, f"{arch} {policy}: prompt of {len(p)} tokens"
