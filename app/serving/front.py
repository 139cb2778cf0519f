"""What the API, the page and the metrics need of a service, whichever engine answers: ServiceFront, the base of
EngineService (this app's own engine, app/serving/service.py) and AttachedService (a vLLM server,
app/serving/attach.py).

It holds what both set up the same way (the record ring and its viewers, the per-client rate limit, the
Prometheus metrics, what is known of the model once started) and what both do the same way: the rate-limit
check at admission and a reply's text as a stream. Each subclass says how a request enters (`submit`),
how the engine is started, stopped and changed, how its records arrive (`_on_record`) and what memory it
holds (`memory`, read by /healthz and /metrics).
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from app.config import ServerConfig
from app.replay.arrival_log import ArrivalLog
from app.serving.broadcast import Broadcaster, RecordRing
from app.serving.prometheus import Metrics
from app.serving.rate_limit import Caller, ClientKeys, RateLimiter
from app.serving.request_stream import QueueFull, RequestStream, reply_text
from engine import SamplingParams


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
        self.settings: dict = {}                # replaced whole whenever the policy changes
        self.accepting = False

    def describe(self) -> dict:
        """The engine as a viewer needs to know it: what runs where, and the settings in force."""
        return {"model": self.model_name, "device": self.device, "dtype": self.dtype,
                "max_model_len": self.max_model_len, "settings": {**self.settings, "step_delay": self.step_delay}}

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
