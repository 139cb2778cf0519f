"""The rate limit: a token bucket per identity (room token, presenter key, API key) or, for anonymous
callers, per address, where X-Forwarded-For counts only when the peer is a proxy the operator named."""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.serving.rate_limit import ClientKeys, RateLimiter, client_of

# ---- the bucket ----


def test_bucket_allows_a_burst_then_refills():
    now = [100.0]
    lim = RateLimiter(per_minute=60, burst=3)
    lim.clock = lambda: now[0]
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


# ---- whose bucket ----
def key(headers: dict, peer: str | None, identity: str | None = None, **keys) -> str | None:
    return ClientKeys(**keys).key(client_of(headers, peer, identity))


def test_forwarded_for_is_ignored_from_an_untrusted_peer():
    assert key({"x-forwarded-for": "1.2.3.4"}, "203.0.113.5") == "addr:203.0.113.5"
    assert key({}, "203.0.113.5") == "addr:203.0.113.5"


def test_forwarded_for_from_a_named_proxy_gives_the_client():
    assert key({"x-forwarded-for": "198.51.100.7"}, "127.0.0.1") == "addr:198.51.100.7"   # the default
    ten = {"forwarded_allow_ips": "10.0.0.0/8"}
    assert key({"x-forwarded-for": "198.51.100.7"}, "10.1.2.3", **ten) == "addr:198.51.100.7"
    # a client's own X-Forwarded-For ends up left of what the proxy appends: the rightmost untrusted hop wins
    assert key({"x-forwarded-for": "1.1.1.1, 198.51.100.7"}, "10.1.2.3", **ten) == "addr:198.51.100.7"
    # two proxies of ours in a row
    assert key({"x-forwarded-for": "9.9.9.9, 198.51.100.7, 10.0.0.2"}, "10.1.2.3", **ten) == "addr:198.51.100.7"
    # '*' trusts whoever connects (a platform whose proxy is the only way in), still only its last hop
    assert key({"x-forwarded-for": "1.1.1.1, 198.51.100.7"}, "172.16.0.9",
               forwarded_allow_ips="*") == "addr:198.51.100.7"
    assert key({"x-forwarded-for": "198.51.100.7"}, "10.1.2.3", forwarded_allow_ips="") == "addr:10.1.2.3"
    # a proxy that forwards garbage: the proxy's own address, not the garbage
    assert key({"x-forwarded-for": "not-an-ip"}, "10.1.2.3", **ten) == "addr:10.1.2.3"


@given(peer=st.sampled_from(["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"]),
       forwarded=st.lists(st.sampled_from(["", "127.0.0.1", "::1", "not-an-ip"]), max_size=3),
       proxies=st.sampled_from(["127.0.0.1", "", "127.0.0.0/8, ::1", "10.0.0.0/8"]))
def test_a_caller_on_loopback_is_not_limited_by_address(peer, forwarded, proxies):
    """The machine's own user, however many of them send at once, and whatever loopback hops they name."""
    assert key({"x-forwarded-for": ", ".join(forwarded)}, peer, forwarded_allow_ips=proxies) is None


@given(client=st.ip_addresses().filter(lambda ip: not ip.is_loopback and not getattr(ip, "ipv4_mapped", None)),
       proxies=st.sampled_from(["127.0.0.1", "127.0.0.0/8, ::1"]))
def test_a_public_caller_behind_a_local_proxy_keeps_its_bucket(client, proxies):
    """A reverse proxy on the machine (loopback) names the caller in X-Forwarded-For: that address is limited."""
    assert key({"x-forwarded-for": str(client)}, "127.0.0.1", forwarded_allow_ips=proxies) == f"addr:{client}"


@given(peer=st.sampled_from(["127.0.0.1", "::1"]))
def test_behind_a_platform_proxy_loopback_is_the_proxy_not_a_caller(peer):
    """With '*' every connection is the platform's proxy: one that sends no header keeps a bucket."""
    assert key({}, peer, forwarded_allow_ips="*") == f"addr:{peer}"


def test_identities_on_loopback_keep_their_buckets():
    assert key({}, "127.0.0.1", identity="room:Ana") == "room:Ana"
    assert key({"x-presenter-key": "secret"}, "127.0.0.1", presenter_key="secret") == "presenter"
    assert key({"authorization": "Bearer k1"}, "::1", api_keys=("k1",)) == "api-key:1"


@given(peer=st.ip_addresses(), forwarded=st.text(max_size=80))
def test_an_untrusted_peer_cannot_choose_its_key(peer, forwarded):
    if (getattr(peer, "ipv4_mapped", None) or peer).is_loopback:
        return                                       # the machine's own user: not limited (below)
    assert key({"x-forwarded-for": forwarded}, str(peer)) == f"addr:{peer}"


def test_identities_get_their_own_buckets():
    assert key({}, "203.0.113.5", identity="room:Ana") == "room:Ana"
    assert key({"x-presenter-key": "secret"}, "203.0.113.5", presenter_key="secret") == "presenter"
    assert key({"x-presenter-key": "wrong"}, "203.0.113.5", presenter_key="secret") == "addr:203.0.113.5"
    keys = {"api_keys": ("k1", "k2")}
    assert key({"authorization": "Bearer k2"}, "203.0.113.5", **keys) == "api-key:2"
    assert key({"authorization": "Bearer nope"}, "203.0.113.5", **keys) == "addr:203.0.113.5"
    assert key({"authorization": "Bearer k1"}, "203.0.113.5") == "addr:203.0.113.5"   # no keys configured
    assert key({}, None) is None                    # in-process callers (scripted scenarios)


def test_a_bad_proxy_list_is_refused_by_name():
    with pytest.raises(ValueError, match="forwarded_allow_ips.*'10.0.0.0/33'"):
        ClientKeys(forwarded_allow_ips="127.0.0.1,10.0.0.0/33")


# ---- flags and environment variables ----
def test_flags_and_environment():
    from app.__main__ import parse_args, server_config
    args = parse_args(["--rate-limit-per-minute", "0", "--rate-limit-burst", "5"], env={})
    cfg = server_config(args, env={})
    assert (cfg.rate_limit_per_minute, cfg.rate_limit_burst, cfg.forwarded_allow_ips) == (0, 5, "127.0.0.1")
    env = {"BATCHSCOPE_RATE_LIMIT_PER_MINUTE": "600", "FORWARDED_ALLOW_IPS": "10.0.0.0/8",
           "BATCHSCOPE_API_KEY": "k1, k2"}
    cfg = server_config(parse_args([], env=env), env=env)
    assert (cfg.rate_limit_per_minute, cfg.forwarded_allow_ips, cfg.api_keys) == (600, "10.0.0.0/8", ("k1", "k2"))
    with pytest.raises(ValueError, match="forwarded_allow_ips"):
        server_config(parse_args(["--forwarded-allow-ips", "ten"], env={}), env={})


# ---- a served room: 60 students behind one NAT, a script, a spoofer ----
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.helpers import save_tiny_model
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


def serve(folder, **server):
    """A tiny random model behind the real app and the room routes; rate limits at their defaults."""
    from app import EngineService, ServerConfig, create_app
    from app.serving.room import Room
    from app.ui.room_pages import mount_room
    from engine import EngineConfig
    service = EngineService(EngineConfig(model=str(folder), kv_cache_gb=0.05, cpu_threads=1), ServerConfig(**server))
    app = create_app(service, manage_service=False)
    mount_room(app, service, Room(), head="", max_tokens=2)
    service.start()
    return app, service


@pytest.fixture(scope="module")
def room_server(tiny_folder):
    app, service = serve(tiny_folder)
    service.limiter.clock = lambda: 1000.0       # no refill while a slow machine serves the requests
    yield app, service
    service.stop()


def client(app, address: str):
    from starlette.testclient import TestClient
    return TestClient(app, client=(address, 40000))


def test_sixty_students_behind_one_nat_are_all_served(room_server):
    app, service = room_server
    assert service.config.rate_limit_burst < 60          # one bucket for the address would run dry
    hall = client(app, "203.0.113.50")
    tokens = [hall.post("/api/room/join", json={"name": f"Student {i}"}).json()["token"] for i in range(60)]
    for round_ in range(2):
        for token in tokens:
            r = hall.post("/api/room/chat", json={"text": "Hi"}, headers={"X-Room-Token": token})
            assert r.status_code == 200, (round_, r.text)
            assert "done" in json.loads(r.text.strip().splitlines()[-1])


def test_an_anonymous_script_is_limited(room_server):
    app, service = room_server
    burst = service.config.rate_limit_burst
    script = client(app, "203.0.113.60")
    body = {"prompt": "Hi", "max_tokens": 1}
    codes = [script.post("/v1/completions", json=body).status_code for _ in range(burst + 3)]
    assert codes[:burst] == [200] * burst and set(codes[burst:]) == {429}
    r = script.post("/v1/completions", json=body)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "too many requests" in r.json()["error"]["message"]
    # ... and only it: the students' room chat from the same address is not
    token = script.post("/api/room/join", json={"name": "Late"}).json()["token"]
    assert script.post("/api/room/chat", json={"text": "Hi"}, headers={"X-Room-Token": token}).status_code == 200


def test_a_spoofed_forwarded_for_does_not_change_the_key(room_server):
    app, service = room_server
    burst = service.config.rate_limit_burst
    spoofer = client(app, "203.0.113.70")
    body = {"prompt": "Hi", "max_tokens": 1}
    codes = [spoofer.post("/v1/completions", json=body, headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code
             for i in range(burst + 3)]
    assert set(codes[burst:]) == {429}


def test_an_api_key_is_needed_when_configured(tiny_folder):
    app, service = serve(tiny_folder, api_keys=("class-key", "other-key"), rate_limit_burst=2)
    service.limiter.clock = lambda: 1000.0
    try:
        check_api_keys(app)
    finally:
        service.stop()


def check_api_keys(app):
    c = client(app, "203.0.113.80")
    r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                  headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/v1/models").status_code == 401
    assert c.get("/health").status_code == 200                  # probes need no key
    body, key = {"prompt": "Hi", "max_tokens": 1}, {"Authorization": "Bearer class-key"}
    assert [c.post("/v1/completions", json=body, headers=key).status_code for _ in range(3)] == [200, 200, 429]
    other = client(app, "203.0.113.81")                          # the same key elsewhere: the same bucket
    assert other.post("/v1/completions", json=body, headers=key).status_code == 429
    assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer other-key"}).status_code == 200


def test_the_serving_preset_is_one_flag_and_explicit_settings_win():
    from app.__main__ import parse_args, server_config
    teaching, serving = parse_args([], env={}), parse_args(["--serving"], env={})
    assert (teaching.max_num_batched_tokens, teaching.max_num_seqs, teaching.rate_limit_per_minute) == (256, 64, 120)
    assert (serving.max_num_batched_tokens, serving.max_num_seqs, serving.rate_limit_per_minute) == (2048, 64, 0)
    assert server_config(serving, env={}).rate_limit_per_minute == 0
    mixed = parse_args(["--serving", "--max-num-seqs", "32"], env={"BATCHSCOPE_RATE_LIMIT_PER_MINUTE": "600"})
    assert (mixed.max_num_seqs, mixed.max_num_batched_tokens, mixed.rate_limit_per_minute) == (32, 2048, 600)
    assert parse_args([], env={"BATCHSCOPE_SERVING": "1"}).max_num_batched_tokens == 2048
