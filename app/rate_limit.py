"""Per-client rate limit: a token bucket per client address, bounded in memory.

A lecture hall behind one NAT shares an address, so the default is generous:
it stops a script hammering the server, not a room of students.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict


class RateLimiter:
    def __init__(self, per_minute: int, burst: int, max_clients: int = 10_000):
        self.rate = per_minute / 60.0            # tokens per second; 0 = no limit
        self.burst = burst
        self.max_clients = max_clients
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()   # client -> (tokens, time)
        self.lock = threading.Lock()

    def retry_after(self, client: str | None) -> int:
        """0 when the client may send now (and is charged one request), else seconds to wait."""
        if not self.rate or client is None:
            return 0
        now = time.monotonic()
        with self.lock:
            tokens, then = self.buckets.pop(client, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            wait = 0 if tokens >= 1 else max(1, math.ceil((1 - tokens) / self.rate))
            self.buckets[client] = (tokens - 1 if not wait else tokens, now)
            while len(self.buckets) > self.max_clients:     # forget the longest-idle clients
                self.buckets.popitem(last=False)
        return wait


def client_of(headers, peer: str | None) -> str | None:
    """The client's address: the first X-Forwarded-For hop (set by the Spaces proxy), else the peer."""
    forwarded = headers.get("x-forwarded-for")
    return forwarded.split(",")[0].strip() if forwarded else peer
