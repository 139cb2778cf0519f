"""The sampler's logprobs against torch's log-softmax, over many random batches (no model needed)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.execution.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduling.sequence import Sequence


def seq(params: SamplingParams, seed: int) -> Sequence:
    s = Sequence("r", "r", [1], params, 0.0)
    s.generator = torch.Generator().manual_seed(seed)
    return s


asks = st.none() | st.integers(0, 20)
row = st.tuples(asks, st.sampled_from([0.0, 0.7, 1.5]), st.integers(0, 2**31))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(row, min_size=1, max_size=6), vocab=st.integers(2, 64), data_seed=st.integers(0, 2**31))
def test_logprobs_are_the_log_softmax_of_the_raw_logits(rows, vocab, data_seed):
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(data_seed)) * 4
    seqs = [seq(SamplingParams(temperature=t, logprobs=None if k is None else min(k, vocab)), s)
            for k, t, s in rows]
    tokens = sample(logits, seqs)
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, (s, token) in enumerate(zip(seqs, tokens)):
        k = s.params.logprobs
        if k is None:
            assert s.logprobs == []
            continue
        ((chosen, top),) = s.logprobs
        assert chosen == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert len(top) == k and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        best = reference[i].topk(k).values.tolist() if k else []
        assert [lp for _, lp in top] == pytest.approx(best, abs=1e-5)
        assert all(reference[i, t].item() == pytest.approx(lp, abs=1e-5) for t, lp in top)
        if s.params.greedy and k:
            assert top[0][1] == pytest.approx(chosen, abs=1e-6)


def test_logprobs_do_not_change_the_tokens():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    plain = sample(logits, [seq(SamplingParams(temperature=1.0), i) for i in range(4)])
    asked = sample(logits, [seq(SamplingParams(temperature=1.0, logprobs=5), i) for i in range(4)])
    assert plain == asked


def test_non_finite_logits_record_nothing():
    logits = torch.tensor([[0.0, math.nan, 1.0], [0.0, 1.0, 2.0]])
    seqs = [seq(SamplingParams(logprobs=2), 0), seq(SamplingParams(logprobs=2), 0)]
    assert sample(logits, seqs) == [None, 2]
    assert seqs[0].logprobs == [] and len(seqs[1].logprobs) == 1


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_logprobs_setting_is_checked(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


# ---- vLLM's extensions: repetition_penalty, min_p, min_tokens ----
def penalised(logits: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    """vLLM's rule, one token at a time: a seen token's positive logit is divided, a negative one multiplied."""
    out = logits.clone()
    for t in seen:
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


@settings(max_examples=100, deadline=None)
@given(vocab=st.integers(2, 50), penalty=st.floats(0.5, 3.0), data_seed=st.integers(0, 2**31),
       prompt=st.lists(st.integers(0, 49), min_size=1, max_size=8), output=st.lists(st.integers(0, 49), max_size=8))
def test_repetition_penalty_is_vllms(vocab, penalty, data_seed, prompt, output):
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(data_seed)) * 3
    s = Sequence("r", "r", [t % vocab for t in prompt], SamplingParams(repetition_penalty=penalty), 0.0)
    s.output_token_ids = [t % vocab for t in output]
    expected = penalised(logits[0], set(s.all_token_ids), penalty)
    assert sample(logits, [s]) == [int(expected.argmax())]


def test_repetition_penalty_changes_a_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    s = Sequence("r", "r", [0], SamplingParams(repetition_penalty=1.5), 0.0)
    assert sample(logits, [s]) == [1]                                # 3/1.5 = 2 < 2.5
    assert sample(logits, [Sequence("r", "r", [0], SamplingParams(), 0.0)]) == [0]


@settings(max_examples=60, deadline=None)
@given(min_p=st.floats(0.01, 1.0), temperature=st.sampled_from([0.5, 1.0, 2.0]), data_seed=st.integers(0, 2**31))
def test_min_p_never_samples_a_token_below_its_threshold(min_p, temperature, data_seed):
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(data_seed)) * 3
    probs = torch.softmax(logits[0] / temperature, -1)
    for i in range(20):
        (token,) = sample(logits, [seq(SamplingParams(temperature=temperature, min_p=min_p), data_seed + i)])
        assert probs[token] >= min_p * probs.max() - 1e-6


def test_min_tokens_bans_end_of_sequence_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])                  # 1 is the end of sequence, 2 a stop token
    def at(n_out: int, **kw) -> int:
        s = Sequence("r", "r", [0], SamplingParams(min_tokens=2, stop_token_ids=[2], **kw), 0.0)
        s.output_token_ids = [3] * n_out
        s.generator = torch.Generator().manual_seed(0)
        return sample(logits, [s], eos_token_ids=frozenset({1}))[0]
    assert at(0) == 3 and at(1) == 3 and at(2) == 1
    assert at(0, temperature=1.0) in (0, 3)


@pytest.mark.parametrize("bad", [dict(min_tokens=-1), dict(min_tokens=9, max_tokens=8), dict(repetition_penalty=0),
                                 dict(min_p=1.5), dict(skip_special_tokens=1)])
def test_extension_settings_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@settings(max_examples=40)
@given(first=st.integers(0, 49150), gap=st.integers(1, 40000), k=st.integers(1, 5), data_seed=st.integers(0, 999))
def test_greedy_token_heads_its_alternatives_when_logits_tie(first, gap, k, data_seed):
    """bf16 logits tie often; the greedy token (argmax: the lowest id among the largest) must head the
    alternatives, and tied alternatives follow in id order, as the OpenAI API's logprobs read."""
    second = (first + gap) % 49152
    if second == first:
        return
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(data_seed)).bfloat16().float()
    logits[0, [first, second]] = 10.0
    s = seq(SamplingParams(temperature=0, logprobs=k), 0)
    (token,) = sample(logits, [s])
    assert token == min(first, second)
    chosen, alternatives = s.logprobs[-1]
    assert alternatives[0][0] == token and alternatives[0][1] == pytest.approx(chosen)
    if k >= 2:
        assert alternatives[1][0] == max(first, second)
