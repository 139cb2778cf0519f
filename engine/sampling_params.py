"""Per-request sampling settings, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20                     # alternatives per token, as OpenAI allows


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    seed: int | None = None           # per-request RNG: same seed, same reply
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False          # benchmarks need fixed output lengths
    logprobs: int | None = None       # None: off; k: each token's logprob and the k most likely (k <= 20)
    # vLLM's extensions, as vLLM defines them
    min_tokens: int = 0               # no end-of-sequence, stop token or stop string before this many tokens
    repetition_penalty: float = 1.0   # > 1 discourages any token already in the prompt or the reply
    min_p: float = 0.0                # drop tokens less likely than min_p x the most likely one's probability
    skip_special_tokens: bool = True  # leave special tokens (<|im_end|>, ...) out of the reply's text

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               f"temperature must be a number in [0, 100], got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               f"seed must be an integer or None, got {self.seed!r}")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a list of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        _check(isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids),
               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")

        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
               and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
               f"repetition_penalty must be a number in (0, 100], got {self.repetition_penalty!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.skip_special_tokens, bool),
               f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rejects NaN


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(message)
