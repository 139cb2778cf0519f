"""The engine boundary: what app/ may call, and what a step gives back.

    outputs = engine.step()                 # StepOutputs | None (None: nothing to do)
    outputs.record                          # the StepRecord dict of docs/step_record.md, or None
    for out in outputs.outputs:             # one RequestOutput per request whose reply moved
        out.request_id, out.text, out.token_ids, out.finish_reason

`LLMEngine` (engine/llm_engine.py), the disaggregated pair (engine/disagg/router.py) and the
switch between them (engine/engines.py) all satisfy `Engine`; a caller never needs to
know which one it holds, nor read a `Sequence`. A source that cannot do something says
so in `settings()` (the pair runs one policy only) or by raising ValueError from
`set_policy`.

Pure Python: importing this module does not import torch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token: str                        # the token's text, decoded alone
    logprob: float
    top: list[tuple[str, float]]      # the most likely tokens at this position, most likely first


@dataclass
class RequestOutput:
    """What one request's reply gained since its previous output. A request gets an output when its
    committed text grew or it ended; tokens that added no text yet ride with the next one."""
    request_id: str
    text: str                         # committed text gained since the previous output
    token_ids: list[int]              # tokens sampled since the previous output
    num_output_tokens: int            # reply tokens so far
    finish_reason: str | None = None  # on the last output only: stop | length | abort | error
    error: str | None = None          # why it ended early (abort reason or failure), with abort | error
    logprobs: list[TokenLogprob] | None = None   # the new tokens', when the request asked for them
    cached_tokens: int = 0            # on the last output: prompt tokens the prefix cache served

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestInfo:
    """A request as admitted: what the server's private arrival log keeps (never published)."""
    request_id: str
    label: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float               # on the engine's clock


@dataclass
class StepOutputs:
    """One call of step(): the record of the forward pass it ran (None if it ran none, e.g. the pair
    had nothing to relay yet) and every request's new output since the previous call, ended ones
    (finished, aborted between steps, failed) included."""
    record: dict | None
    outputs: list[RequestOutput] = field(default_factory=list)


@runtime_checkable
class Engine(Protocol):
    """Requests in, one StepRecord per forward pass and each request's new output out.

    Single-threaded: one thread calls all of it (app/serving/engine_loop.py's engine thread)."""

    model_name: str
    max_model_len: int
    eos_token_ids: set[int]           # the model's end tokens (a reply under ignore_eos runs on past them)
    device: str
    step_index: int                   # the number the next step record gets
    num_waiting: int                  # requests queued, not yet running (the server's queue limit reads it)

    def add_request(self, prompt: str | None = None, messages: list[dict] | None = None,
                    prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                    label: str | None = None, request_id: str | None = None) -> str:
        """Queue a request and return its id; ValueError/TypeError name what is wrong with it."""

    def request_info(self, request_id: str) -> RequestInfo:
        """The admitted request (its label, prompt ids, params, arrival). KeyError if unknown."""

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """End a request and free its KV; False if it had already ended. KeyError if unknown."""

    def step(self) -> StepOutputs | None:
        """Run (or relay) one step. None when there was nothing to do and nothing to report."""

    def take_outputs(self) -> list[RequestOutput]:
        """New output of requests that moved outside a step (an abort between steps)."""

    def has_unfinished(self) -> bool: ...

    def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                   max_num_seqs: int | None = None, **max_prefill_chunk) -> None:
        """Change the settings from the next step on; None keeps a value. ValueError if refused."""

    def settings(self) -> dict:
        """policy, max_num_batched_tokens, max_num_seqs, max_prefill_chunk, speculative_config in force."""

    def stats(self) -> dict:
        """settings plus model, device, KV use, queue lengths, counters, memory() (the /api/engine state)."""

    def memory(self) -> dict:
        """rss_bytes (this process's resident memory) and kv_cache_bytes (its KV cache's tensors), from
        engine/memory.py and the runner; an engine with worker processes adds `workers`, the same per worker."""

    def subscribe(self, fn: Callable[[dict], None]) -> None:
        """fn gets every StepRecord, request event and policy event, as a dict of its own."""

    def unsubscribe(self, fn: Callable[[dict], None]) -> None: ...

    def close(self) -> None:
        """Release what outlives the object (worker processes, shared memory); requests in flight are dropped."""
