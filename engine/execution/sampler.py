"""From logits to the next token of each sequence: greedy, temperature, min-p, top-k, top-p, seeded.

Before choosing, a sequence's row may be adjusted as vLLM does: a repetition
penalty on every token of its prompt and reply (a positive logit divided by it,
a negative one multiplied), and, while it has fewer than min_tokens output
tokens, its end-of-sequence and stop tokens banned. Rows that ask for neither
and are greedy take the batch's one argmax.

A sequence whose params ask for logprobs also gets, per sampled token, the
token's log-probability and the `logprobs` most likely alternatives, taken
from the model's own distribution (log-softmax of the raw logits, before
temperature, top-k or top-p), as OpenAI and vLLM report them.
"""
from __future__ import annotations

import torch

from engine.scheduling.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int] = frozenset()
           ) -> list[int | None]:
    """logits: (num_seqs, vocab). Returns one token per sequence, None where its logits are not finite.
    eos_token_ids: the model's end-of-sequence ids, banned (with stop_token_ids) before min_tokens."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()          # one host sync for the whole batch
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()   # one reduction: any NaN/inf makes the sum non-finite
    for i, seq in enumerate(seqs):
        if not finite[i]:
            tokens[i] = None
            continue
        raw = logits[i]
        row = _adjusted(raw, seq, eos_token_ids)
        if not seq.params.greedy:
            tokens[i] = _sample_one(row, seq)
        elif row is not raw:
            tokens[i] = int(row.argmax())
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None and tokens[i] is not None]
    if rows:
        _record_logprobs(logits[rows], [tokens[i] for i in rows], [seqs[i] for i in rows])
    return tokens


def _adjusted(row: torch.Tensor, seq: Sequence, eos_token_ids: frozenset[int]) -> torch.Tensor:
    """row: (vocab,) logits; the same tensor when nothing applies, else an adjusted copy."""
    p, vocab = seq.params, row.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in seq.all_token_ids if t < vocab}), device=row.device)
        old = row[seen]
        row = row.clone()
        row[seen] = torch.where(old > 0, old / p.repetition_penalty, old * p.repetition_penalty)
    if seq.num_output_tokens < p.min_tokens:
        banned = [t for t in eos_token_ids.union(p.stop_token_ids) if t < vocab]
        if banned:
            row = row.clone()
            row[banned] = float("-inf")
    return row


def _sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    logits = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
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
        alternatives = _tied_in_id_order(logprobs[i], top_ids[i], top_values[i])[:n] if n else []
        seq.logprobs.append((chosen[i], alternatives))


def _tied_in_id_order(row: torch.Tensor, ids: list[int], values: list[float]) -> list[tuple[int, float]]:
    """topk's (id, logprob) with equal logprobs in id order, as argmax breaks ties (bf16 logits tie
    often), so a greedy token heads its alternatives. Ties at the k-th value may reach below topk's pick."""
    at_kth = (row == values[-1]).nonzero().flatten()
    if len(at_kth) > 1 and len(at_kth) <= 64:
        above = [(t, v) for t, v in zip(ids, values) if v > values[-1]]
        ids = [t for t, _ in above] + sorted(at_kth.tolist())
        values = [v for _, v in above] + [values[-1]] * len(at_kth)
    return sorted(zip(ids, values), key=lambda x: (-x[1], x[0]))[:len(values)]
