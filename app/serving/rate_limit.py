"""Rate limit: a token bucket per caller, bounded in memory, and whose bucket a request spends.

A caller is who they are where the server knows (a student's room token, the
presenter key, an API key when the operator configured some) and their address
otherwise. A lecture hall behind one NAT shares an address, so students are
never limited by it: each spends their own token's bucket. The address is the
peer's, unless the peer is a proxy the operator named (`--forwarded-allow-ips`,
as uvicorn's flag of that name); only then does X-Forwarded-For count, read
from the right, so a client cannot pick its own key by sending the header.

An anonymous caller whose address is loopback is not limited: every caller on
127.0.0.1 or ::1 is the machine's own user (a lecturer's benchmark, a room
simulated on one laptop), and one bucket for all of them turned away half of a
60-student burst. Where every connection comes through a proxy (`"*"`), a
loopback peer is that proxy, not a caller, and keeps its bucket. A tunnel that
forwards public traffic to loopback without X-Forwarded-For makes every caller
look local: name its address in `--forwarded-allow-ips` and make it send the header.
"""
from __future__ import annotations

import hmac
import ipaddress
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


class RateLimiter:
    def __init__(self, per_minute: int, burst: int, max_clients: int = 10_000):
        self.rate = per_minute / 60.0            # tokens per second; 0 = no limit
        self.burst = burst
        self.max_clients = max_clients
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()   # key -> (tokens, time)
        self.lock = threading.Lock()
        self.clock = time.monotonic             # tests freeze it

    def retry_after(self, client: str | None) -> int:
        """0 when the client may send now (and is charged one request), else seconds to wait."""
        if not self.rate or client is None:
            return 0
        now = self.clock()
        with self.lock:
            tokens, then = self.buckets.pop(client, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            wait = 0 if tokens >= 1 else max(1, math.ceil((1 - tokens) / self.rate))
            self.buckets[client] = (tokens - 1 if not wait else tokens, now)
            while len(self.buckets) > self.max_clients:     # forget the longest-idle clients
                self.buckets.popitem(last=False)
        return wait


@dataclass(frozen=True)
class Caller:
    """What a request says about its sender; ClientKeys decides what of it to believe."""
    peer: str | None                 # the connection's address (None: an in-process call)
    forwarded: tuple[str, ...] = ()  # X-Forwarded-For hops, left (farthest) to right (nearest)
    presenter_key: str | None = None
    api_key: str | None = None       # Authorization: Bearer <key>
    identity: str | None = None      # set by a route that has already checked who this is ("room:Ana")


def client_of(headers, peer: str | None, identity: str | None = None) -> Caller | None:
    """The caller of a request. headers: any mapping with lower-case .get (Starlette's, a dict)."""
    if peer is None and identity is None:
        return None
    forwarded = tuple(h.strip() for h in (headers.get("x-forwarded-for") or "").split(",") if h.strip())
    return Caller(peer, forwarded, headers.get("x-presenter-key"), bearer(headers), identity)


def bearer(headers) -> str | None:
    """The key of `Authorization: Bearer <key>`, if the request has one."""
    auth = headers.get("authorization") or ""
    return (auth[7:].strip() or None) if auth[:7].lower() == "bearer " else None


class ClientKeys:
    """Caller -> the key of the bucket it spends: "room:<label>", "presenter", "api-key:<n>" or "addr:<ip>";
    None (not limited) for in-process callers and anonymous ones on loopback.

    forwarded_allow_ips: comma-separated addresses or networks of trusted proxies, or "*" for whoever
    connects (only where every connection comes through a proxy, as on a hosting platform); "" for none.
    """

    def __init__(self, forwarded_allow_ips: str = "127.0.0.1", presenter_key: str | None = None,
                 api_keys: tuple[str, ...] = ()):
        self.trust_any_peer, self.proxies = parse_proxies(forwarded_allow_ips)
        self.presenter_key, self.api_keys = presenter_key, api_keys

    def key(self, caller: Caller | None) -> str | None:
        if caller is None:
            return None                              # in-process callers (scripted scenarios) are not limited
        if caller.identity:
            return caller.identity
        if self.presenter_key and caller.presenter_key and _same(caller.presenter_key, self.presenter_key):
            return "presenter"
        if (n := self.api_key_number(caller.api_key)) is not None:
            return f"api-key:{n}"
        address = self.address(caller)
        if self.is_local(address):
            return None                              # the machine's own user (see the module's docstring)
        return f"addr:{address}"

    def is_local(self, address: str | None) -> bool:
        """A loopback address, believed as the caller's own only when not every peer is a proxy."""
        ip = _ip(address) if address else None
        ip = getattr(ip, "ipv4_mapped", None) or ip      # ::ffff:127.0.0.1, as a dual-stack socket gives it
        return ip is not None and ip.is_loopback and not self.trust_any_peer

    def api_key_number(self, given: str | None) -> int | None:
        """1-based index of the configured key given (compared in constant time), else None."""
        found = None
        for i, k in enumerate(self.api_keys, 1):
            if given is not None and _same(given, k):
                found = i
        return found

    def address(self, caller: Caller) -> str | None:
        """The peer, or, when the peer is a trusted proxy, the nearest forwarded hop that is not one."""
        if caller.peer is None or not (self.trust_any_peer or self._trusted(caller.peer)):
            return caller.peer
        client = caller.peer
        for hop in reversed(caller.forwarded):
            if _ip(hop) is None:
                break                                # a malformed hop: believe nothing beyond it
            client = hop
            if not self._trusted(hop):
                break
        return client

    def _trusted(self, address: str) -> bool:
        ip = _ip(address)
        return ip is not None and any(ip in net for net in self.proxies)


def parse_proxies(spec: str) -> tuple[bool, list]:
    """"*" or "10.0.0.0/8, 127.0.0.1" -> (trust any peer, networks); ValueError naming a bad entry."""
    items = [x.strip() for x in (spec or "").split(",") if x.strip()]
    nets = []
    for x in items:
        if x == "*":
            continue
        try:
            nets.append(ipaddress.ip_network(x, strict=False))
        except ValueError:
            raise ValueError(f"forwarded_allow_ips: {x!r} is not an IP address or network "
                             f"(give a comma-separated list, or '*')") from None
    return "*" in items, nets


def _ip(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
