"""From logits to the next token of each sequence: greedy, temperature, min-p, top-k, top-p, seeded.

Before choosing, a sequence's row may be adjusted as vLLM does: a repetition
penalty on every token of its prompt and reply (a positive logit divided by it,
a negative one multiplied), and, while it has fewer than min_tokens output
tokens, its end-of-sequence and stop tokens banned. Rows that ask for neither
and are greedy take the batch's one argmax.

A decode that verifies drafted tokens (speculative decoding, engine/scheduling/ngram.py)
has a row per position: row i is the model's distribution for the token after its
first i drafts. `verify` keeps the drafts the model agrees with and samples one token
after them, so the reply is distributed exactly as without drafts (greedy: the same
tokens). A prompt-lookup draft is one token, not a distribution: a point mass q(x) = 1.
Speculative sampling's rule, accept x with probability min(1, p(x) / q(x)), becomes
accept x with probability p(x); on a rejection the next token comes from the residual
max(0, p - q), normalised: p with x removed. Then P(token = x) = p(x) (accepted) and
P(token = y != x) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y): the target, untouched.

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


def sample_runs(logits: torch.Tensor, seqs: list[Sequence], num_rows: list[int],
                eos_token_ids: frozenset[int] = frozenset()) -> list[int | list[int] | None]:
    """logits: (sum(num_rows), vocab), each sequence's rows in turn. A sequence of one row gets its token
    (as sample()); one of k + 1 rows, verifying its k drafts, gets the list of the drafts it accepted
    and the token after them (verify()); None where its logits are not finite."""
    starts = [0]
    for n in num_rows:
        starts.append(starts[-1] + n)
    single = [i for i, n in enumerate(num_rows) if n == 1]
    out: list = [None] * len(seqs)
    if single:
        rows = torch.tensor([starts[i] for i in single], device=logits.device)
        for i, token in zip(single, sample(logits[rows], [seqs[i] for i in single], eos_token_ids)):
            out[i] = token
    for i, n in enumerate(num_rows):
        if n > 1:
            out[i] = verify(logits[starts[i]:starts[i] + n], seqs[i], seqs[i].draft_token_ids[:n - 1], eos_token_ids)
    return out


def verify(logits: torch.Tensor, seq: Sequence, drafts: list[int], eos_token_ids: frozenset[int] = frozenset()
           ) -> list[int] | None:
    """logits: (k + 1, vocab), row i after the sequence and drafts[:i]. Returns the accepted drafts and
    one token after them (1 to k + 1 tokens), or None when a row is not finite.

    Greedy: a draft is kept while it is the argmax; the first that is not is replaced by the argmax,
    so the tokens are those of decoding one by one. Sampling: draft x is kept with probability p(x);
    on a rejection the token is drawn from p with x removed (module docstring: the target exactly)."""
    logits = logits.float()
    if not bool(torch.isfinite(logits.sum(dim=-1)).all()):
        return None
    p, history, out = seq.params, seq.all_token_ids, []
    for i in range(len(drafts) + 1):
        row = _adjusted(logits[i], seq, eos_token_ids, history + out, seq.num_output_tokens + len(out))
        if p.greedy:
            token = int(row.argmax())
        else:
            probs = target_probs(row, p)
            if i < len(drafts):
                x = drafts[i]
                if float(torch.rand((), generator=seq.generator, device=probs.device)) < float(probs[x]):
                    out.append(x)
                    continue
                probs = probs.clone()
                probs[x] = 0.0                    # the residual: p with the rejected draft removed
            token = int(torch.multinomial(probs, 1, generator=seq.generator).item())
        if i < len(drafts) and token == drafts[i]:
            out.append(token)
            continue
        out.append(token)
        break
    if p.logprobs is not None:
        _record_logprobs(logits[:len(out)], out, [seq] * len(out))
    return out


def _adjusted(row: torch.Tensor, seq: Sequence, eos_token_ids: frozenset[int],
              history: list[int] | None = None, num_output: int | None = None) -> torch.Tensor:
    """row: (vocab,) logits; the same tensor when nothing applies, else an adjusted copy.
    history, num_output: the tokens before this row and how many are reply (default: the sequence's;
    a verified row also counts the drafts before it)."""
    p, vocab = seq.params, row.shape[-1]
    history = seq.all_token_ids if history is None else history
    num_output = seq.num_output_tokens if num_output is None else num_output
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in history if t < vocab}), device=row.device)
        old = row[seen]
        row = row.clone()
        row[seen] = torch.where(old > 0, old / p.repetition_penalty, old * p.repetition_penalty)
    if num_output < p.min_tokens:
        banned = [t for t in eos_token_ids.union(p.stop_token_ids) if t < vocab]
        if banned:
            row = row.clone()
            row[banned] = float("-inf")
    return row


def _sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    return int(torch.multinomial(target_probs(logits, seq.params), 1, generator=seq.generator).item())


def target_probs(logits: torch.Tensor, p) -> torch.Tensor:
    """(vocab,) logits -> the distribution a token is drawn from: temperature, min-p, top-k, top-p."""
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
        probs = probs / probs.sum()     # a distribution again: verify() compares a draft's p(x) with a uniform draw
    return probs


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
