"""Server settings: one small dataclass, checked when it is built.

The engine has its own EngineConfig; this one holds what only the web layer
needs: where to listen, the slow-motion delay, the presenter key and the
limits that keep one busy classroom from taking the server down.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from app.serving.rate_limit import parse_proxies


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7860
    step_delay: float = 0.0           # seconds of pause after each step (slow motion for a class)
    presenter_key: str | None = None  # when set, changing the engine needs it; never logged or echoed
    # when set, /v1 needs `Authorization: Bearer <one of them>`; never echoed
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    forwarded_allow_ips: str = "127.0.0.1"  # proxies whose X-Forwarded-For is believed: IPs/networks, "*", ""
    served_model_name: str | None = None  # the name /v1/models shows; defaults to the model's name
    public_url: str | None = None     # the address students reach this server at (the projector's join link)
    # ---- limits ----
    max_waiting: int = 128            # queued requests beyond which chat answers 429 (docs/ui.md: a room of 60)
    retry_after_s: int = 2            # the Retry-After a 429 suggests
    max_tokens_cap: int = 4096        # largest max_tokens a request may ask for
    default_max_tokens: int = 512     # used when a request gives none
    max_body_bytes: int = 1 << 20     # request bodies of the JSON API
    max_ws_subscribers: int = 128     # step-stream viewers at once (a room: 60 students, projector, lecturer)
    # chat requests (API and UI) one caller may send: a room member, the presenter, an API key, or an
    # anonymous address (app/serving/rate_limit.py); 0 = off
    rate_limit_per_minute: int = 120
    rate_limit_burst: int = 30        # of which this many at once
    ws_buffer: int = 512              # messages a viewer may fall behind before older ones are dropped
    history: int = 4096               # records (steps + events) kept for snapshots and traces
    snapshot_steps: int = 200         # steps a new viewer receives on connect
    health_recovery_s: float = 10.0   # /healthz stays unhealthy this long after an engine-loop crash
    shutdown_timeout_s: float = 10.0  # graceful shutdown gives up on connections after this

    def __post_init__(self):
        _positive_int("port", self.port, low=0)
        for name in ("rate_limit_burst", "max_waiting", "max_tokens_cap", "default_max_tokens", "max_body_bytes",
                     "max_ws_subscribers", "ws_buffer", "history", "snapshot_steps", "retry_after_s"):
            _positive_int(name, getattr(self, name))
        _positive_int("rate_limit_per_minute", self.rate_limit_per_minute, low=0)
        check_step_delay(self.step_delay)
        self.default_max_tokens = min(self.default_max_tokens, self.max_tokens_cap)   # a lower cap wins
        if self.ws_buffer > self.history:
            raise ValueError(f"ws_buffer ({self.ws_buffer}) must not exceed history ({self.history})")
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise ValueError(f"public_url must start with http:// or https://, got {self.public_url!r}")
        if self.presenter_key == "":
            self.presenter_key = None     # an empty variable means "no key", not "the empty key"
        if isinstance(self.api_keys, str):
            self.api_keys = tuple(k.strip() for k in self.api_keys.split(",") if k.strip())
        self.api_keys = tuple(self.api_keys)
        parse_proxies(self.forwarded_allow_ips)   # a typo in the proxy list must not trust the wrong peers


def check_step_delay(value) -> float:
    # an upper bound keeps a typo (500 instead of 0.5) from freezing a live class
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 10:
        raise ValueError(f"step_delay must be a number of seconds in [0, 10], got {value!r}")
    return float(value)


def _positive_int(name: str, value, low: int = 1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
