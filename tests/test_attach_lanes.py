"""Attach mode over several vLLM engines (data parallelism) and the what-if routes it refuses, against stand-ins:
integrations/vllm's Publisher sending records as each engine's recording scheduler does (the real schedulers:
tests/test_vllm_dp.py, in the vLLM environment)."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from app.serving.attach_records import Lanes
from integrations.vllm.publisher import Publisher
from tests.fake_vllm import SETTINGS, attached, step  # noqa: F401  (attached: the fixture)

pytestmark = pytest.mark.server


def hello(lane: int, engine: str = "vllm 0.32.0") -> dict:
    # lanes 1: a dense model's engines each believe they are alone (vLLM runs them as independent ones)
    return {"type": "hello", "engine": engine, "lane": lane, "lanes": 1, "device": "cpu/float32",
            "settings": SETTINGS, "time": time.time()}


def free_run(n: int) -> int:
    """A port p with p + 1 ... p + n - 1 free too."""
    for _ in range(50):
        socks = []
        try:
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            socks.append(first)
            p = first.getsockname()[1]
            for k in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p + k))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free run of ports")


def test_the_engines_at_the_next_ports_are_read_as_lanes():
    base = free_run(4)
    pubs = [Publisher("127.0.0.1", base, hello(0)), Publisher("127.0.0.1", base + 1, hello(1)),
            Publisher("127.0.0.1", base + 2, hello(2, engine="vllm 0.31.0"))]   # another server: not a lane
    got, lock = [], threading.Lock()

    def take(obj):
        with lock:
            got.append(obj)
    lanes = Lanes("127.0.0.1", base, take, time.time())
    try:
        lanes.start(5.0)
        assert lanes.lanes == 2
        t = time.time()
        for n in range(3):
            for lane in (0, 1):
                pubs[lane].publish(step(n, t + n, [{"req": f"e{lane}r", "label": f"U{lane}", "kind": "decode",
                                                    "tokens": 1, "start": 5 + n}]))
        deadline = time.monotonic() + 10
        while sum(o["type"] == "step" for o in list(got)) < 6:
            assert time.monotonic() < deadline, "the records did not arrive"
            time.sleep(0.05)
        assert lanes.healthy
    finally:
        lanes.stop()
        for p in pubs:
            p.close()
    steps = [o for o in got if o["type"] == "step"]
    assert sorted(s["step"] for s in steps) == list(range(6))
    for lane in (0, 1):
        mine = [s for s in steps if s["lane"] == lane]
        assert [s["lane_step"] for s in mine] == [0, 1, 2]
        assert {it["req"] for s in mine for it in s["items"]} == {f"e{lane}r"}


def test_a_lane_the_first_hello_names_is_retried_until_it_answers():
    """A MoE model's engines know their number: a lane that is not up yet is reconnected, and reported meanwhile."""
    base = free_run(2)
    first = hello(0)
    first["lanes"] = 2
    pub0 = Publisher("127.0.0.1", base, first)
    lanes = Lanes("127.0.0.1", base, lambda obj: None, time.time())
    try:
        lanes.start(5.0)
        assert lanes.lanes == 2
        deadline = time.monotonic() + 5
        while lanes.healthy:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "vLLM engine 1" in lanes.errors[1]
        pub1 = Publisher("127.0.0.1", base + 1, hello(1))
        deadline = time.monotonic() + 10
        while not lanes.healthy:
            assert time.monotonic() < deadline, lanes.errors
            time.sleep(0.1)
        pub1.close()
    finally:
        lanes.stop()
        pub0.close()


def test_the_what_if_routes_say_why_they_cannot_run(attached):  # noqa: F811
    """The page polls GET /api/whatif: attached to vLLM it answers 400 with the reason, never a 500."""
    http, *_ = attached
    for path in ("/api/whatif", "/api/whatif/log"):
        r = http.get(path)
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"], (path, r.text)


@pytest.mark.browser
def test_the_page_draws_one_lane_per_vllm_engine():
    """Two engines' records through attach mode: the chart's rows are a lane per engine, each named."""
    import httpx
    import uvicorn

    from app.__main__ import build, parse_args
    from tests.browser import CHROMIUM, chromium, live_page
    from tests.fake_vllm import Thread, fake_vllm
    from tests.fake_vllm import free_port as free
    if not CHROMIUM.exists():
        pytest.skip("Debian's Chromium (/usr/bin/chromium) is not installed; browser tests need it")
    base = free_run(2)
    pubs = [Publisher("127.0.0.1", base + lane, hello(lane)) for lane in (0, 1)]
    vport, aport = free(), free()
    vllm = Thread(uvicorn.Config(fake_vllm([]), host="127.0.0.1", port=vport, log_level="warning"))
    vllm.run_in_thread()
    service, asgi = build(parse_args(["--attach", f"http://127.0.0.1:{vport}", "--attach-records",
                                      f"127.0.0.1:{base}", "--port", str(aport)]), env={})
    service.start()
    app = Thread(uvicorn.Config(asgi, host="127.0.0.1", port=aport, log_level="warning"))
    app.run_in_thread()
    try:
        t = time.time()
        for n in range(4):
            for lane in (0, 1):
                pubs[lane].publish(step(n, t + 0.1 * n, [{"req": f"e{lane}", "label": ("Alice", "Bob")[lane],
                                                          "kind": "decode", "tokens": 1, "start": 5 + n}]))
        deadline = time.monotonic() + 10
        while sum(r["type"] == "step" for r in httpx.get(f"http://127.0.0.1:{aport}/api/trace",
                                                          trust_env=False).json()["records"]) < 8:
            assert time.monotonic() < deadline, "the records did not arrive"
            time.sleep(0.05)
        with chromium() as browser, live_page(browser, f"http://127.0.0.1:{aport}",
                                              {"width": 1400, "height": 900}) as pg:
            pg.wait_for_function("() => BS.view.drawn && BS.view.drawn.rows.some((r) => r.header)", timeout=20000)
            rows = pg.evaluate("() => BS.view.drawn.rows.map((r) => [r.lane, r.header, r.label])")
            names = pg.evaluate("() => [BS.laneName('dp0'), BS.laneName('dp1')]")
            legend = pg.locator("[data-testid=legend-handover]")
            assert legend.count() == 0 or not legend.is_visible(), "no KV hand-over between vLLM's engines"
    finally:
        app.should_exit = vllm.should_exit = True
        service.stop()
        for p in pubs:
            p.close()
    assert [r[0] for r in rows if r[1]] == ["dp0", "dp1"]
    assert [(r[0], r[2]) for r in rows if not r[1]] == [("dp0", "Alice"), ("dp1", "Bob")]
    assert names == ["vLLM engine 0", "vLLM engine 1"]
