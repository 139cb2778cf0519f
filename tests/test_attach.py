"""Attach mode (app/serving/attach.py) against a stand-in for vLLM: its OpenAI API (a small FastAPI app that
streams like vLLM and remembers what it was sent) and its recorder (integrations/vllm's Publisher,
sending records as the recording scheduler does). A real vLLM: tests/test_vllm_e2e.py."""
from __future__ import annotations

import json
import time

import pytest
import uvicorn

from app.config import ServerConfig
from app.serving.attach import AttachConfig, AttachedService
from integrations.vllm.publisher import Publisher
from tests.fake_vllm import SETTINGS, Thread, attached, fake_vllm, free_port, step  # noqa: F401 (attached: the fixture)

pytestmark = pytest.mark.server


def test_records_from_vllm_reach_the_trace_renumbered_and_on_the_apps_clock(attached):
    http, pub, _, service = attached
    t = time.time()
    pub.publish(step(500, t, [{"req": "r1", "label": "Doc", "kind": "prefill", "tokens": 64, "start": 0,
                               "prompt_len": 300, "completes_prompt": False}]))
    pub.publish(step(501, t + 0.1, [{"req": "r0", "label": "Alice", "kind": "decode", "tokens": 1, "start": 20}]))
    deadline = time.monotonic() + 10
    while len(steps := [r for r in http.get("/api/trace").json()["records"] if r["type"] == "step"]) < 2:
        assert time.monotonic() < deadline, "the records did not arrive"
        time.sleep(0.05)
    assert [(r["step"], r["lane_step"]) for r in steps] == [(0, 500), (1, 501)]
    service.start()                             # as the app's lifespan does after `python -m app` started it
    assert pub.num_readers == 1, "attached once: every record read once"
    assert 0 <= steps[0]["t_start"] < 60, "seconds since the app attached"
    trace = http.get("/api/trace").json()
    assert trace["engine"] == "vllm 0.32.0" and trace["settings"]["max_num_batched_tokens"] == 64
    policy = [r for r in trace["records"] if r["type"] == "policy"]
    assert policy and policy[0]["engine"] == "vllm 0.32.0"


def test_settings_are_read_only_with_the_values_in_force(attached):
    http, *_ = attached
    state = http.get("/api/engine").json()
    assert state["policy"] == "chunked" and state["max_num_seqs"] == 8 and state["async_scheduling"] is True
    assert "read_only" in state
    r = http.post("/api/engine", json={"max_num_batched_tokens": 128})
    assert r.status_code == 400 and "restart vLLM" in r.json()["error"]["message"]


def test_chats_are_relayed_with_the_users_name(attached):
    http, _, sent, _ = attached
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                "user": "Alice"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["choices"][0]["message"]["content"] == "Hello there!"
            and body["choices"][0]["finish_reason"] == "length")
    assert body["usage"]["prompt_tokens"] == 9 and body["usage"]["completion_tokens"] == 3
    assert sent[-1]["request_id"] == "Alice" and sent[-1]["user"] == "Alice" and sent[-1]["stream"] is True
    with http.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 2, "stream": True}) as s:
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                       for line in s.iter_lines() if line.startswith("data: {") and '"choices":[{' in line)
    assert text == "Hello there"


def test_what_vllm_refuses_is_the_clients_error(attached):
    http, *_ = attached
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 200}]})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_the_what_if_replay_says_why_it_cannot_run(attached):
    http, *_ = attached
    r = http.post("/api/whatif", json={"settings": [{"policy": "chunked"}]})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


def test_unreachable_vllm_and_missing_recorder_are_named():
    dead = free_port()
    with pytest.raises(ConnectionError, match="vLLM does not answer at"):
        AttachedService(AttachConfig(f"http://127.0.0.1:{dead}", timeout_s=2)).start()
    sent: list[dict] = []
    vport = free_port()
    vllm = Thread(uvicorn.Config(fake_vllm(sent), host="127.0.0.1", port=vport, log_level="warning"))
    vllm.run_in_thread()
    try:
        with pytest.raises(ConnectionError, match="--scheduler-cls integrations.vllm.RecordingScheduler"):
            AttachedService(AttachConfig(f"http://127.0.0.1:{vport}", f"127.0.0.1:{dead}", timeout_s=2)).start()
    finally:
        vllm.should_exit = True
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        AttachConfig("localhost:8000")


def test_serve_with_attach_exits_with_the_reason(capsys):
    from app.__main__ import main
    assert main(["--attach", f"http://127.0.0.1:{free_port()}", "--port", "0"]) == 1
    assert "vLLM does not answer" in capsys.readouterr().err


def test_data_parallel_engines_become_one_stream_with_lanes():
    """Two engines' recorders (ports P and P+1): the app learns of the second from the first's hello,
    reads both, numbers their steps as one stream and keeps each step's engine in `lane`."""
    hello = lambda lane: {"type": "hello", "engine": "vllm 0.32.0", "lane": lane, "lanes": 2,
                          "device": "cpu/float32", "settings": SETTINGS, "time": time.time()}
    for _ in range(20):                         # two neighbouring free ports
        first = Publisher("127.0.0.1", 0, hello(0))
        p = first.port
        try:
            pubs = [first, Publisher("127.0.0.1", p + 1, hello(1))]
            break
        except OSError:
            first.close()
    sent: list[dict] = []
    vport = free_port()
    vllm = Thread(uvicorn.Config(fake_vllm(sent), host="127.0.0.1", port=vport, log_level="warning"))
    vllm.run_in_thread()
    service = AttachedService(AttachConfig(f"http://127.0.0.1:{vport}", f"127.0.0.1:{p}"), ServerConfig())
    try:
        service.start()
        deadline = time.monotonic() + 10
        while any(pub.num_readers == 0 for pub in pubs):
            assert time.monotonic() < deadline, "the app did not connect to both engines"
            time.sleep(0.05)
        t = time.time()
        for lane, pub in enumerate(pubs):
            pub.publish(step(7, t + lane, [{"req": f"r{lane}", "label": "Alice", "kind": "decode", "tokens": 1,
                                            "start": 5}]))
        while len(steps := [r for r in service.ring.last_steps(10)[1] if r["type"] == "step"]) < 2:
            assert time.monotonic() < deadline, "the records did not arrive"
            time.sleep(0.05)
        assert sorted(r["step"] for r in steps) == [0, 1] and {r["lane"] for r in steps} == {0, 1}
        assert {r["lane_step"] for r in steps} == {7}
        assert service.health() == (True, "ok")
        pubs[1].close()                         # one engine's stream drops: health names it
        while service.health()[0]:
            assert time.monotonic() < deadline + 10, "a lost lane was not noticed"
            time.sleep(0.1)
        assert "engine 1" in service.health()[1] and "engine 0" not in service.health()[1]
    finally:
        vllm.should_exit = True
        service.stop()
        for pub in pubs:
            pub.close()


def test_a_scripted_scenario_plays_over_vllm_unheld(attached):
    """The lesson runner holds only its own engine: over an attached vLLM it counts the records instead."""
    import asyncio

    from app.replay.scenarios import Arrival, Scenario
    from app.ui import lessons
    from app.ui.sessions import Session
    *_, service = attached
    session = Session()
    scenario = Scenario("over-vllm", "one user", (Arrival(0, "Ann", 3, messages=({"role": "user", "content": "Hi"},)),))
    asyncio.run(lessons.play(service, session, scenario, asyncio.Event(), "en"))
    (turn,) = [t for p in session.panels for t in p.turns]
    assert turn.done and not turn.error and turn.reply == "Hello there!"


def test_vllms_drafts_prefix_hits_and_preemptions_reach_the_trace_and_metrics(attached):
    """The recorder's `cached`, `drafted`/`accepted` and `preempted` go through attach mode unchanged, and
    /metrics counts vLLM's drafts and prefix hits from them under vLLM's family names."""
    http, pub, _, _ = attached
    t = time.time()
    pub.publish({"type": "request", "event": "arrived", "req": "r2", "label": "Eve", "t": t, "prompt_len": 64})
    pub.publish(step(10, t, [{"req": "r2", "label": "Eve", "kind": "prefill", "tokens": 16, "start": 48,
                              "prompt_len": 64, "completes_prompt": True, "cached": 48}]))
    spec = step(11, t + 0.1, [{"req": "r2", "label": "Eve", "kind": "decode", "tokens": 4, "start": 64,
                               "drafted": 3, "accepted": 2}])
    pub.publish({**spec, "speculative": 3})
    pub.publish({**step(12, t + 0.2, []), "preempted": ["r2"]})
    deadline = time.monotonic() + 10
    while len(steps := [r for r in http.get("/api/trace").json()["records"] if r["type"] == "step"]) < 3:
        assert time.monotonic() < deadline, "the records did not arrive"
        time.sleep(0.05)
    assert steps[0]["items"][0]["cached"] == 48
    assert steps[1]["speculative"] == 3 and (steps[1]["items"][0]["drafted"],
                                             steps[1]["items"][0]["accepted"]) == (3, 2)
    assert steps[2]["preempted"] == ["r2"]
    text = http.get("/metrics").text

    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
    assert value("vllm:spec_decode_num_draft_tokens_total") == 3
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 2
    assert value("vllm:num_preemptions_total") == 1
    assert value("vllm:prefix_cache_hits_total") == 48
