"""What the API, the page and the metrics need of a service, whichever engine answers: ServiceFront, the base of
EngineService (this app's own engine, app/serving/service.py) and AttachedService (a vLLM server,
app/serving/attach.py).

It holds what both set up the same way (the record ring and its viewers, the per-client rate limit, the
Prometheus metrics, what is known of the model once started) and what both do the same way: the rate-limit
check at admission and a reply's text as a stream. Each subclass says how a request enters (`submit`),
how the engine is started, stopped and changed, how its records arrive (`_on_record`) and what memory it
holds (`memory`, read by /healthz and /metrics).

RequestStream: one request's reply, delivered to the event loop that asked for it.

Each engine step returns every request's new output (engine/protocol.py's
RequestOutput: text and tokens gained, finish reason, logprobs); the engine
thread hands each event loop its readers' outputs in one call_soon_threadsafe
(deliver): one wake-up per loop per step, not per request.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from app.config import ServerConfig
from app.replay.arrival_log import ArrivalLog
from app.serving.broadcast import Broadcaster, RecordRing
from app.serving.prometheus import Metrics
from app.serving.rate_limit import Caller, ClientKeys, RateLimiter
from engine import SamplingParams
from engine.errors import QueueFull, ServiceUnavailable, ShuttingDown
from engine.protocol import RequestOutput, TokenLogprob

__all__ = ["Delta", "QueueFull", "RequestStream", "ServiceFront", "ServiceUnavailable", "ShuttingDown", "TokenLogprob",
           "deliver", "reply_text"]


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


class ServiceFront:
    def __init__(self, config: ServerConfig | None, arrival_log: ArrivalLog):
        self.config = config or ServerConfig()
        self.ring = RecordRing(self.config.history)
        self.broadcaster = Broadcaster(self.ring, self.config.ws_buffer, self.config.max_ws_subscribers)
        self.broadcaster.describe = self.describe
        self.limiter = RateLimiter(self.config.rate_limit_per_minute, self.config.rate_limit_burst)
        self.client_keys = ClientKeys(self.config.forwarded_allow_ips, self.config.presenter_key, self.config.api_keys)
        self.metrics = Metrics(memory=self.memory)    # the subclass's memory(): resident and KV bytes
        self.arrival_log = arrival_log      # private: token ids for the what-if replay (app/replay/whatif.py)
        # ---- filled in from the engine when start() returns; read-only afterwards ----
        self.model_name = self.device = self.dtype = None
        self.cuda_graphs: dict | None = None    # buckets, capture seconds and graph memory (None: eager steps)
        self.max_model_len = 0
        self.eos_token_ids: frozenset[int] = frozenset()   # the model's end tokens; unknown (none) for a vLLM
        self.settings: dict = {}                # replaced whole whenever the policy changes
        self.accepting = False

    def describe(self) -> dict:
        """The engine as a viewer needs to know it: what runs where, and the settings in force."""
        return {"model": self.model_name, "device": self.device, "dtype": self.dtype,
                "max_model_len": self.max_model_len, "settings": {**self.settings, "step_delay": self.step_delay}}

    def announce(self, message: dict):
        """Event loop: one of the app's own messages (a lesson's start or end, app/ui/lessons.py) to every
        viewer, in order with the records, and into the ring, so an exported trace keeps it. The last lesson
        message is kept for the snapshots of viewers who join later."""
        if message.get("type") == "lesson":
            self.broadcaster.lesson = message
        self.broadcaster.publish(message)
        self.broadcaster.flush()

    def check_rate(self, client: Caller | None):
        """QueueFull when the client is over its rate limit (client: app.serving.rate_limit.client_of; None, an
        in-process caller, is not limited); a request that passes spends one token of the client's bucket."""
        wait = self.limiter.retry_after(self.client_keys.key(client))
        if wait:
            raise QueueFull(f"too many requests from this client ({self.config.rate_limit_per_minute} a minute); "
                            f"try again in {wait} s", wait)

    async def submit(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                     label: str | None = None, client: Caller | None = None) -> RequestStream:
        raise NotImplementedError

    async def stream(self, messages: list[dict], params: SamplingParams | None = None,
                     label: str | None = None) -> AsyncIterator[str]:
        """The reply's text, piece by piece. Leaving the loop early aborts the request."""
        stream = await self.submit(messages=messages, params=params, label=label)
        async for text in reply_text(stream):
            yield text
