"""The sampler's logprobs against torch's log-softmax, over many random batches (no model needed)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


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
