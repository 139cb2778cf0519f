"""The per-client rate limit: a token bucket per address, and a 429 with Retry-After from the API."""
import asyncio

import pytest

from app.rate_limit import RateLimiter, client_of


def test_bucket_allows_a_burst_then_refills(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("app.rate_limit.time.monotonic", lambda: now[0])
    lim = RateLimiter(per_minute=60, burst=3)
    assert [lim.retry_after("a") for _ in range(3)] == [0, 0, 0]
    assert lim.retry_after("a") == 1                 # one token a second
    assert lim.retry_after("b") == 0                 # other clients have their own bucket
    now[0] += 1.0
    assert lim.retry_after("a") == 0 and lim.retry_after("a") == 1


def test_off_and_unknown_clients_are_not_limited():
    assert all(RateLimiter(0, 1).retry_after("a") == 0 for _ in range(10))
    assert all(RateLimiter(60, 1).retry_after(None) == 0 for _ in range(10))


def test_memory_stays_bounded():
    lim = RateLimiter(60, 5, max_clients=100)
    for i in range(1000):
        lim.retry_after(f"10.0.{i // 256}.{i % 256}")
    assert len(lim.buckets) == 100


def test_forwarded_address_wins():
    assert client_of({"x-forwarded-for": "1.2.3.4, 10.0.0.1"}, "127.0.0.1") == "1.2.3.4"
    assert client_of({}, "127.0.0.1") == "127.0.0.1"


@pytest.mark.server
def test_api_answers_429_with_retry_after(live_server):
    limiter = live_server.service.limiter
    saved = limiter.rate, limiter.burst
    limiter.rate, limiter.burst = 1 / 60, 2          # two requests, then one a minute
    try:
        headers = {"x-forwarded-for": "203.0.113.7"}
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        codes = [live_server.http.post("/v1/chat/completions", json=body, headers=headers) for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        assert int(codes[2].headers["retry-after"]) > 0
        assert "too many requests" in codes[2].json()["error"]["message"]
        other = live_server.http.post("/v1/chat/completions", json=body, headers={"x-forwarded-for": "198.51.100.1"})
        assert other.status_code == 200              # everyone else carries on
    finally:
        limiter.rate, limiter.burst = saved
