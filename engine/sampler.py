"""From logits to the next token of each sequence: greedy, temperature, top-k, top-p, seeded."""
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
