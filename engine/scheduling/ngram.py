"""Speculative decoding's drafter: n-gram prompt lookup, configured as vLLM configures it.

A decode step computes one token per reply, yet on a small batch it costs about the
same as a step of a few tokens more: the weights are read once either way. So guess
the next k tokens cheaply, run them in the same forward pass as the reply's own token,
and keep the guesses the model agrees with. One pass then yields 1 to k + 1 tokens.

Prompt lookup guesses by copying: replies often repeat their context (a name, a list
item, code being edited, a document being summarised). Take the last n tokens of the
sequence (n from prompt_lookup_max down to prompt_lookup_min), find an earlier place
where the same n tokens appear, and propose the tokens that followed them there:

    tokens:  ... the red fox jumps over the red fox [?]       last 2 tokens: "red fox"
    earlier:     the red fox jumps                            -> draft "jumps over the ..."

No second model, no extra memory: a draft is a few list compares per reply and step.
The longest match wins; among equally long ones, the latest (the nearest context).

What happens to the draft is the rest of the engine's business: the scheduler gives a
decode 1 + (up to k) tokens under the same token budget as everyone (scheduler.py,
rule `decode_one_token`); the runner computes logits at every one of those positions;
the sampler keeps the longest agreeing prefix (execution/sampler.py `verify`, which
keeps the target distribution exactly); the scheduler's update rolls the KV of the
rejected guesses back. Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for prompt lookup: {"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_max": N} (prompt_lookup_min optional). As in vLLM, a missing bound takes the other's value."""
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"

    @classmethod
    def of(cls, spec: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A checked config from vLLM's dict form; a ValueError names the key that is wrong."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict like {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}}, got {spec!r}")
        unknown = sorted(set(spec) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
        if spec.get("method") not in METHODS:
            raise ValueError(f"speculative_config: key 'method' must be one of {METHODS}, got {spec.get('method')!r}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config: key 'num_speculative_tokens' is missing")
        for key in KEYS[1:]:
            v = spec.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config: key {key!r} must be a positive integer, got {v!r}")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            raise ValueError("speculative_config: key 'prompt_lookup_max' is missing (ngram needs the n-gram size)")
        lo, hi = lo or hi, hi or lo
        if lo > hi:
            raise ValueError(f"speculative_config: key 'prompt_lookup_min' ({lo}) is above prompt_lookup_max ({hi})")
        return cls(spec["num_speculative_tokens"], hi, lo)

    def to_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}


def propose(tokens: list[int], k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (n_min..n_max tokens long); [] when no suffix of n_min tokens occurs earlier."""
    size = len(tokens)
    if k < 1 or size < n_min + 1:
        return []
    last, best_n, best_end = tokens[-1], 0, -1
    for end in range(size - 2, -1, -1):            # end: last index of an earlier occurrence, latest first
        if tokens[end] != last:
            continue
        n = 1
        while n < n_max and end - n >= 0 and tokens[end - n] == tokens[size - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == n_max:
                break
    if best_n < n_min:
        return []
    return tokens[best_end + 1:best_end + 1 + k]
