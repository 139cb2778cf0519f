"""RequestStream: one request's reply, delivered to the event loop that asked for it.

The engine thread computes each live request's new text after a step
(collect_deltas) and hands all of it to each event loop in one
call_soon_threadsafe (deliver): one wake-up per loop per step, not per request.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


class QueueFull(Exception):
    """Too many requests are waiting; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ServiceUnavailable(Exception):
    """The model is loading or the server is shutting down."""


@dataclass
class Delta:
    text: str                         # committed text the reply gained since the previous delta
    completion_tokens: int            # output tokens so far
    finish_reason: str | None = None  # on the last delta only: stop | length | abort | error
    error: str | None = None          # why it ended early (abort reason or engine failure)
    logprobs: list[TokenLogprob] | None = None   # the new tokens', when the request asked for them
    cached_tokens: int = 0            # on the last delta: prompt tokens the prefix cache served


@dataclass
class TokenLogprob:
    token: str                        # the token's text, decoded alone
    logprob: float
    top: list[tuple[str, float]]      # the most likely tokens at this position, most likely first


class RequestStream:
    """`async for delta in stream` until the last delta; `async with stream` aborts it on an early exit."""

    def __init__(self, loop: asyncio.AbstractEventLoop, abort: Callable[[RequestStream, str], None]):
        """loop: the event loop that reads it; abort(stream, reason): stops the request (any thread)."""
        self.loop, self._abort = loop, abort
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()   # unbounded, but one reply's worth at most
        self.id: str | None = None    # set on the engine thread when the request is added
        self.label: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0        # prompt tokens served by the prefix cache, known at the end
        self.sent_chars = 0           # engine thread: characters of output_text already pushed
        self.sent_logprobs = 0        # engine thread: tokens whose logprobs were already pushed

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while self.finish_reason is None:
            delta = await self.queue.get()
            self.completion_tokens = delta.completion_tokens
            if delta.finish_reason is not None:
                self.finish_reason, self.error = delta.finish_reason, delta.error
                self.cached_tokens = delta.cached_tokens
            yield delta

    async def text(self) -> str:
        return "".join([d.text async for d in self])

    def close(self, reason: str = "client went away"):
        """Abort the request unless it has already ended; frees its KV blocks at once."""
        if self.finish_reason is None:
            self._abort(self, reason)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc):
        self.close()


def collect_deltas(engine, streams: dict[str, RequestStream]) -> dict:
    """Engine thread: what each live request gained since the last push, grouped by event loop.

    Finished requests get their last delta (with finish_reason) and leave `streams`.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Delta]]] = {}
    for rid, stream in list(streams.items()):
        seq = engine.get_request(rid)
        text = seq.output_text
        if len(text) == stream.sent_chars and not seq.is_finished:
            continue
        delta = Delta(text[stream.sent_chars:], seq.num_output_tokens)
        stream.sent_chars = len(text)
        if seq.params.logprobs is not None:
            new = range(stream.sent_logprobs, len(seq.logprobs))
            delta.logprobs = [_named(engine.tokenizer, seq.output_token_ids[i], *seq.logprobs[i]) for i in new]
            stream.sent_logprobs = len(seq.logprobs)
        if seq.is_finished:
            delta.finish_reason, delta.cached_tokens = seq.finish_reason, seq.num_cached_tokens
            delta.error = seq.error if seq.finish_reason in ("error", "abort") else None
            del streams[rid]
        by_loop.setdefault(stream.loop, []).append((stream, delta))
    return by_loop


def _named(tokenizer, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
    """Engine thread (the tokenizer is the engine's): token ids to their text."""
    text = lambda t: tokenizer.decode([t])
    return TokenLogprob(text(token), logprob, [(text(t), lp) for t, lp in top])


def deliver(by_loop: dict):
    """Any thread: put each delta on its stream's queue, on that stream's event loop."""
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:                # that loop has closed; its readers are gone
            pass


def _put_all(items: list[tuple[RequestStream, Delta]]):
    for stream, delta in items:
        stream.queue.put_nowait(delta)
