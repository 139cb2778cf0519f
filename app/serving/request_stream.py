"""RequestStream: one request's reply, delivered to the event loop that asked for it.

Each engine step returns every request's new output (engine/protocol.py's
RequestOutput: text and tokens gained, finish reason, logprobs); the engine
thread hands each event loop its readers' outputs in one call_soon_threadsafe
(deliver): one wake-up per loop per step, not per request.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.errors import QueueFull, ServiceUnavailable, ShuttingDown
from engine.protocol import RequestOutput, TokenLogprob

__all__ = ["Delta", "QueueFull", "RequestStream", "ServiceUnavailable", "ShuttingDown", "TokenLogprob", "deliver"]


Delta = RequestOutput                 # what a reader gets: one per output of its request


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
        self.failure: Exception | None = None   # engine thread, before its last delta: ShuttingDown when
                                                # the server's end aborted it (app/api/errors.py maps the type)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while self.finish_reason is None:
            delta = await self.queue.get()
            self.completion_tokens = delta.num_output_tokens
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


async def reply_text(stream: RequestStream) -> AsyncIterator[str]:
    """A submitted request's reply text, piece by piece (a failure raises RuntimeError with its reason).
    Leaving the loop early aborts the request."""
    async with stream:
        async for delta in stream:
            if delta.error:
                raise RuntimeError(delta.error)
            if delta.text:
                yield delta.text
