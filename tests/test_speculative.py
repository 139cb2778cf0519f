"""Speculative decoding (n-gram prompt lookup) inside the flat batch: the drafter, its config, the scheduler's
rule and KV roll-back, greedy equality with transformers under every policy, and rejection sampling that keeps
the target distribution (chi-square over seeded trials)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.execution.sampler import target_probs, verify
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.ngram import SpeculativeConfig, propose
from engine.scheduling.policies import resolve
from engine.scheduling.policy import Policy, PolicyError
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence
from tests.helpers import CHAT_PROMPTS, hf_greedy, save_tiny_model

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


# ---- the drafter ----
def reference_propose(tokens, k, n_max, n_min):
    """The longest suffix (n_max down to n_min) seen earlier, its latest occurrence: the tokens after it."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[size - n:]:
                return tokens[end + 1:end + 1 + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(0, 6), n_max=st.integers(1, 5),
       n_min=st.integers(1, 5))
def test_propose_is_the_longest_latest_match(tokens, k, n_max, n_min):
    n_min = min(n_min, n_max)
    assert propose(tokens, k, n_max, n_min) == reference_propose(tokens, k, n_max, n_min)


def test_propose_copies_what_followed():
    assert propose([5, 6, 7, 8, 1, 5, 6], 3, 2) == [7, 8, 1]
    assert propose([1, 2, 3], 3, 2) == []                        # nothing seen twice


@pytest.mark.parametrize("bad, key", [
    ({"method": "eagle", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "method"),
    ({"method": "ngram", "prompt_lookup_max": 3}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 3}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "4"}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "draft_model": "x"}, "draft_model"),
])
def test_a_bad_config_names_its_key(bad, key):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.of(bad)
    with pytest.raises(ValueError, match=key):
        EngineConfig(speculative_config=bad, device="cpu")


def test_vllm_defaults_a_missing_bound_to_the_other():
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4},
                     device="cpu").speculative_config
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (2, 4, 4)


# ---- the scheduler: 1 + k tokens, k <= drafts, and no block leaks ----
def make_seq(i: int, prompt_len: int, max_tokens: int = 1000) -> Sequence:
    return Sequence(f"r{i}", f"r{i}", [(7 * i + j) % 50 for j in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens), 0.0)


class Greedy(Policy):
    """Runs every decode with `extra` drafted tokens on top of its own, whatever it has."""
    name = "greedy-drafts"

    def __init__(self, extra: int):
        self.extra = extra

    def schedule(self, step):
        for r in step.decodes:
            step.run(r, 1 + self.extra)


def running_decode(sched: Scheduler, bm: BlockManager, seq: Sequence):
    sched.add(seq)
    batch = sched.schedule()
    sched.update(batch, [3], 0.0)
    assert seq.is_prefill_done


def test_a_decode_runs_at_most_its_drafts():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, resolve("chunked"), 64, 8)
    seq = make_seq(0, 6)
    running_decode(sched, bm, seq)
    sched.set_policy(Greedy(1), 64, 8, None)
    with pytest.raises(PolicyError, match="decode_one_token") as err:
        sched.schedule()                           # no drafts: exactly one token
    assert "0 drafted" in str(err.value)
    seq.draft_token_ids = [4, 5, 6]
    sched.set_policy(Greedy(4), 64, 8, None)
    with pytest.raises(PolicyError, match="decode_one_token"):
        sched.schedule()                           # 1 + 4 > 1 + 3
    sched.set_policy(Greedy(3), 64, 8, None)
    batch = sched.schedule()
    assert [(s.id, n) for s, n in batch.items] == [("r0", 4)]
    out = sched.update(batch, [[4, 9]], 0.0)      # draft 4 kept, 5 rejected: 9 instead
    assert [t for _, t in out] == [4, 9] and batch.accepted == {"r0": 1}
    assert seq.output_token_ids == [3, 4, 9] and seq.num_computed_tokens == seq.num_tokens - 1
    assert len(seq.block_table) == -(-seq.num_computed_tokens // 4) and seq.draft_token_ids == []


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), block_size=st.integers(1, 8), blocks=st.integers(12, 80),
       budget=st.integers(1, 48), policy=st.sampled_from(["static", "continuous", "chunked"]),
       k=st.integers(1, 5))
# a preempted reply, re-admitted with all but its last token found in the prefix cache, is a decode; a
# continuous step with a prompt in it takes it back out (step.drop), and the block taken for its next token goes back
@example(seed=5201535, block_size=3, blocks=12, budget=8, policy="continuous", k=1)
def test_drafts_stay_in_the_rules_and_leak_no_block(seed, block_size, blocks, budget, policy, k):
    rng = random.Random(seed)
    bm = BlockManager(blocks, block_size)
    sched = Scheduler(bm, resolve(policy), budget, 6)
    live = []
    for i in range(rng.randint(1, 6)):
        s = make_seq(i, rng.randint(1, 3 * block_size), max_tokens=rng.randint(2, 12))
        if s.prompt_len + s.params.max_tokens + k <= blocks * block_size // 2:
            sched.add(s)
            live.append(s)
    for _ in range(400):
        if not sched.has_work():
            break
        for s in sched.running:
            s.draft_token_ids = [rng.randrange(50) for _ in range(rng.randint(0, k))] if s.is_prefill_done else []
        batch = sched.schedule()
        assert batch.num_tokens <= budget or len(batch.items) == 1
        tokens = []
        for s, n in batch.items:
            assert n == 1 or (s.is_prefill_done and n - 1 <= len(s.draft_token_ids)) or not s.is_prefill_done
            if s.is_prefill_done and n > 1:
                a = rng.randint(0, n - 1)
                tokens.append(s.draft_token_ids[:a] + [rng.randrange(50)])
            elif s.num_computed_tokens + n == s.num_tokens:
                tokens.append(rng.randrange(50))
        for s, _ in sched.update(batch, tokens, 0.0):
            if s.num_output_tokens >= s.params.max_tokens and not s.is_finished:
                s.status = s.status.FINISHED
                sched.remove(s)
        for s in sched.running:        # the KV covers what was computed, and not a block more
            assert len(s.block_table) == -(-s.num_computed_tokens // block_size)
        held = {b for s in sched.running for b in s.block_table}
        assert bm.num_used == len(held)
    for s in list(sched.running) + list(sched.waiting):
        sched.remove(s)
    assert bm.num_free == blocks


# ---- rejection sampling keeps the target distribution ----
def draw(logits, drafts, params, trials):
    """The first token and, where draft 0 was kept, the second token of `trials` seeded verifications."""
    first, second = [], []
    for t in range(trials):
        s = Sequence("r", "r", [1, 2], params, 0.0, output_token_ids=[2])
        s.generator = torch.Generator().manual_seed(t)
        out = verify(logits, s, drafts)
        first.append(out[0])
        if out[0] == drafts[0]:
            second.append(out[1])
    return first, second


def chi_square_p(samples, probs):
    vocab = len(probs)
    observed = [samples.count(x) for x in range(vocab)]
    keep = [x for x in range(vocab) if probs[x] > 0]
    assert all(observed[x] == 0 for x in range(vocab) if probs[x] == 0), "a token the target never draws"
    total = sum(probs[x] for x in keep)
    expected = [probs[x] / total * len(samples) for x in keep]
    return chisquare([observed[x] for x in keep], expected).pvalue


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.97), (1.3, 0, 0.9)])
def test_verification_samples_the_target_distribution(temperature, top_k, top_p):
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(5)) * 1.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=10)
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]    # a likely and an unlikely guess
    first, second = draw(logits, drafts, params, 6000)
    assert chi_square_p(first, target_probs(logits[0], params).tolist()) > 1e-3
    assert len(second) > 300
    assert chi_square_p(second, target_probs(logits[1], params).tolist()) > 1e-3


def test_a_draft_that_top_p_alone_keeps_is_always_kept():
    """top_p keeps only the draft: the target is that one token, so no verification may reject it (a
    rejection would leave nothing to draw from: a lecture's room, sampling with top_p under the speculative
    lesson, had replies fail with 'invalid multinomial distribution')."""
    logits = torch.tensor([[0.0, 2.0, 0.5, 0.1], [0.3, 0.2, 0.1, 0.0]])
    params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=10)
    probs = target_probs(logits[0], params)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    first, _ = draw(logits, [1], params, 500)
    assert first == [1] * 500


def test_always_accepting_would_be_caught():
    """The test above can fail: a verifier that keeps every draft draws the draft, not the target."""
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(5)) * 1.5
    probs = target_probs(logits[0], SamplingParams(temperature=1.0)).tolist()
    assert chi_square_p([0] * 3000, probs) < 1e-6


def test_greedy_verification_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    s = Sequence("r", "r", [1], SamplingParams(max_tokens=9), 0.0, output_token_ids=[1])
    assert verify(logits, s, [1, 0]) == [1, 0, 2]       # both kept, then the bonus token
    assert verify(logits, s, [1, 2]) == [1, 0]          # the second replaced by the argmax
    assert verify(logits, s, [2, 0]) == [1]


# ---- the engine: greedy output equals transformers, under every policy ----
@pytest.fixture(scope="module")
def references(default_engine_fp32, hf_default_model):
    eng = default_engine_fp32
    texts = [*CHAT_PROMPTS, "Copy this sentence exactly: the quick brown fox jumps over the lazy dog.",
             "Repeat the word hello ten times."]        # replies that copy: drafts kept and rejected
    prompts = [eng.tokenize(messages=[{"role": "user", "content": p}]) for p in texts]
    return [(ids, hf_greedy(hf_default_model, ids, 24)) for ids in prompts]


@pytest.mark.model
@pytest.mark.parametrize("policy", ["static", "continuous", "chunked"])
@pytest.mark.parametrize("budget", [8, 64])
def test_default_model_with_drafts_matches_transformers(default_engine_fp32, references, policy, budget):
    eng = default_engine_fp32
    steps = []
    eng.subscribe(steps.append)
    eng.set_policy(policy, max_num_batched_tokens=budget, max_num_seqs=4)
    eng.set_policy(speculative_config=SPEC)
    try:
        rids = [eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=24)) for ids, _ in references]
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.set_policy(speculative_config=None)
        eng.unsubscribe(steps.append)
    for (ids, ref), r in zip(references, rids):
        assert eng.get_request(r).output_token_ids == ref, f"{policy}/{budget}: prompt of {len(ids)} tokens diverged"
    assert eng.block_manager.num_used == 0
    items = [it for rec in steps if rec.get("type") == "step" for it in rec["items"] if it.get("drafted")]
    if budget >= 64:            # room for drafts beside four replies (at 8 they are mostly squeezed out)
        assert sum(it["accepted"] for it in items) > 0, "no draft was ever kept: verification went untested"
        assert sum(it["drafted"] - it["accepted"] for it in items) > 0, "no draft was ever rejected"
    assert all(it["tokens"] == 1 + it["drafted"] and it["kind"] == "decode" for it in items)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_with_drafts_match_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM
    folder = save_tiny_model(arch, tmp_path / arch)
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() * 2 for n in (3, 20, 45)]
    refs = [hf_greedy(ref_model, p, 16, eos=False) for p in prompts]
    for policy, budget in [("chunked", 16), ("continuous", 64), ("static", 32)]:
        eng = LLMEngine(EngineConfig(model=str(folder), dtype="float32", policy=policy, max_num_batched_tokens=budget,
                                     block_size=8, num_kv_blocks=128,
                                     speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                         "prompt_lookup_max": 2, "prompt_lookup_min": 1}))
        rids = [eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=16, ignore_eos=True))
                for p in prompts]
        while eng.has_unfinished():
            eng.step()
        for p, ref, r in zip(prompts, refs, rids):
            assert eng.get_request(r).output_token_ids == ref, f"{arch} {policy}: prompt of {len(p)} tokens"
        assert eng.block_manager.num_used == 0


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(1, 5), vocab=st.integers(2, 6), penalty=st.sampled_from([1.0, 1.3]),
       min_tokens=st.integers(0, 4), data=st.data())
def test_greedy_verification_is_one_by_one_decoding(seed, k, vocab, penalty, min_tokens, data):
    """Search: any logits, any drafts, a repetition penalty and min_tokens that change each row by what came
    before it: verify() gives the tokens that decoding one row at a time (sample()) gives, up to the first miss."""
    from engine.execution.sampler import sample
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    drafts = data.draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k))
    params = SamplingParams(max_tokens=20, repetition_penalty=penalty, min_tokens=min_tokens)
    out = verify(logits, Sequence("r", "r", [0, 1], params, 0.0, output_token_ids=[1]), drafts, frozenset({0}))
    expected = []
    for i in range(k + 1):
        one = Sequence("r", "r", [0, 1], params, 0.0, output_token_ids=[1, *expected])
        token = sample(logits[i:i + 1], [one], frozenset({0}))[0]
        expected.append(token)
        if i == k or token != drafts[i]:
            break
    assert out == expected


@pytest.mark.model
def test_a_stop_inside_an_accepted_run_ends_the_reply_there(default_engine_fp32):
    """A stop token among the drafts a step kept ends the reply at it, as without drafts, and the step
    record counts only the tokens the reply kept (`accepted` + 1 of them)."""
    eng = default_engine_fp32
    ids = eng.tokenize(messages=[{"role": "user", "content": "Repeat this list three times: red apple, green "
                                                              "pear, yellow lemon, purple plum."}])

    def run(spec, stop):
        steps = []
        eng.subscribe(steps.append)
        eng.set_policy(speculative_config=spec)
        try:
            r = eng.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=40, stop_token_ids=stop,
                                                                       ignore_eos=True))
            while eng.has_unfinished():
                eng.step()
        finally:
            eng.set_policy(speculative_config=None)
            eng.unsubscribe(steps.append)
        items = [it for s in steps if s.get("type") == "step" for it in s["items"] if it["req"] == r]
        return eng.get_request(r).output_token_ids, items

    out, items = run(SPEC, [])
    # a step that kept two drafts or more; its second kept token, seen nowhere earlier in the reply, becomes a stop
    runs = [(it["start"] + 1 - len(ids), it["accepted"]) for it in items if it.get("accepted", 0) >= 2]
    first, _ = next((i, a) for i, a in runs if out[i + 1] not in out[:i + 1])
    stop = out[first + 1]
    plain, _ = run(None, [stop])
    spec_out, spec_items = run(SPEC, [stop])
    assert spec_out == plain == out[:first + 2]
    last = spec_items[-1]
    assert last["accepted"] == 1 and last["drafted"] >= 2, last
    assert sum(1 + it.get("accepted", 0) for it in spec_items if it["kind"] == "decode") + 1 == len(spec_out)
