"""A request's state as it moves through the engine.

Counters are derived from two lists (prompt + output token ids) and one number
(num_computed_tokens: how many of those tokens have KV in the cache), so they
can never drift out of sync.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class Status(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sequence:
    id: str
    label: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose K/V are in the cache
    num_cached_tokens: int = 0        # of those, served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    # timings on the engine clock
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    num_preemptions: int = 0
    last_scheduled: int = -1          # scheduler step that last ran it: decodes rotate by it
    # speculative decoding (engine/scheduling/ngram.py): tokens guessed to follow, to be verified by the
    # next step (a decode running 1 + k tokens checks the first k of them); never part of the reply itself
    draft_token_ids: list[int] = field(default_factory=list)
    # incremental detokenisation (see Detokenizer)
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    text_buffer: str = ""             # decoded but held back: may be the start of a stop string
    generator: object = None          # torch.Generator for seeded sampling
    logprobs: list = field(default_factory=list)  # when params.logprobs is set: per output token (logprob, top)

    # ---- derived sizes ----
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_num_tokens(self) -> int:
        """The most tokens it can ever hold: its prompt and a full reply (drafts never pass it)."""
        return self.prompt_len + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill_done(self) -> bool:
        """Only the newest sampled token is missing from the cache: the next step is a decode."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def stop_reason(self, eos_token_ids: set[int], max_model_len: int) -> str | None:
        """Why the newest token ends the reply: `stop` (an end-of-sequence or stop token), `length`
        (max_tokens reached, or the model's context is full), None when it goes on. Stop strings
        are the detokenizer's to find: they need the text."""
        p, token = self.params, self.output_token_ids[-1]
        if (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def append_token(self, token: int, now: float):
        self.output_token_ids.append(token)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
