"""From logits to the next token of each sequence: greedy, temperature, top-k, top-p, seeded.

A sequence whose params ask for logprobs also gets, per sampled token, the
token's log-probability and the `logprobs` most likely alternatives, taken
from the model's own distribution (log-softmax of the raw logits, before
temperature, top-k or top-p), as OpenAI and vLLM report them.
"""
from __future__ import annotations

import torch

from engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
    """logits: (num_seqs, vocab). Returns one token per sequence, None where its logits are not finite."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()          # one host sync for the whole batch
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()   # one reduction: any NaN/inf makes the sum non-finite
    for i, seq in enumerate(seqs):
        if not finite[i]:
            tokens[i] = None
        elif not seq.params.greedy:
            tokens[i] = _sample_one(logits[i], seq)
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None and tokens[i] is not None]
    if rows:
        _record_logprobs(logits[rows], [tokens[i] for i in rows], [seqs[i] for i in rows])
    return tokens


def _sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs > p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())


def _record_logprobs(logits: torch.Tensor, tokens: list[int], seqs: list[Sequence]):
    """logits: (rows, vocab) of the sequences that asked. Appends (token logprob, [(id, logprob), ...])
    to each one's seq.logprobs, the alternatives most likely first."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(seq.params.logprobs for seq in seqs)
    top = logprobs.topk(k, dim=-1) if k else None
    top_values, top_ids = (top.values.tolist(), top.indices.tolist()) if k else ([], [])
    for i, seq in enumerate(seqs):
        n = seq.params.logprobs
        alternatives = list(zip(top_ids[i][:n], top_values[i][:n])) if n else []
        seq.logprobs.append((chosen[i], alternatives))
