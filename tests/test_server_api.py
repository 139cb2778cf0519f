"""The OpenAI-compatible API on a real server: the official client, concurrency, limits, bad input.
What the reply says ('Paris') is asked of the real default model (real_server); the rest runs on the
tiny random model (live_server), whose replies always run to max_tokens."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
import pytest

from tests.helpers import TINY_MODEL_NAME

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]
QUESTION = "What is the capital of France?"


def test_health_and_models(real_server):
    r = real_server.http.get("/healthz")
    assert r.status_code == 200
    health = r.json()
    memory = health.pop("memory")               # the process's resident memory and its KV cache (test_server_memory)
    assert health == {"status": "ok", "model": "SmolLM2-135M-Instruct", "device": "cpu", "cuda_graphs": None}
    assert memory["rss_bytes"] > memory["kv_cache_bytes"] > 0
    models = real_server.openai().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_openai_client_streams_and_matches_the_non_streamed_reply(real_server):
    client = real_server.openai()
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert "Paris" in text
    assert finishes in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens > 10
    assert 1 <= usage.completion_tokens <= 12 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].choices[0].delta.role == "assistant"

    # greedy: the same request without streaming gives the same text and the same counts
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                          messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0)
    assert full.choices[0].message.content == text
    assert full.choices[0].finish_reason == finishes[0]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)


def test_length_stop_and_seed(real_server):
    client = real_server.openai()
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=5, temperature=0,
                                       messages=[{"role": "user", "content": "Tell me a long story."}],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=12, temperature=0,
                                       messages=[{"role": "user", "content": QUESTION}], stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content
    sampled = [client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=6, temperature=1.0,
                                              top_p=0.9, seed=7, messages=[{"role": "user", "content": "Hi"}])
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_two_clients_share_a_step(live_server):
    async def both():
        client = live_server.openai(asynchronous=True)

        async def one(name: str):
            stream = await client.chat.completions.create(
                model=TINY_MODEL_NAME, messages=[{"role": "user", "content": f"Say hello to {name}."}],
                max_tokens=10, temperature=0, stream=True, user=name, extra_body={"ignore_eos": True})
            ids, text = set(), ""
            async for c in stream:
                ids.add(c.id)
                text += (c.choices[0].delta.content or "") if c.choices else ""
            return ids.pop(), text
        return await asyncio.gather(one("Alice"), one("Bob"))

    (id_a, text_a), (id_b, text_b) = asyncio.run(both())
    assert text_a and text_b
    rid_a, rid_b = id_a.removeprefix("chatcmpl-"), id_b.removeprefix("chatcmpl-")
    steps = [r for r in live_server.records() if r["type"] == "step"]
    shared = [s for s in steps if {rid_a, rid_b} <= {i["req"] for i in s["items"]}]
    assert shared, "no step ran both requests"
    labels = {i["req"]: i["label"] for s in shared for i in s["items"]}
    assert labels[rid_a] == "Alice" and labels[rid_b] == "Bob"


BAD = [  # (body, status, words the message must contain, param)
    ("{not json", 400, "not valid JSON", None),
    ("[1, 2]", 400, "JSON object", None),
    ("", 400, "empty", None),
    ('{"model": "%s"}' % TINY_MODEL_NAME, 400, "Missing required parameter: 'messages'", "messages"),
    ({"messages": "hello"}, 400, "messages", "messages"),
    ({"messages": []}, 400, "non-empty", "messages"),
    ({"messages": [{"role": "user"}]}, 400, "content", "messages.0.content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "must be a string", "messages.0.content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "role", "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "text",
     "messages.0.content"),
    ({"n": "two"}, 400, "'n'", "n"),
    ({"n": 9}, 400, "between 1 and 8", "n"),
    ({"n": 0}, 400, "between 1 and 8", "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "tools"),
    ({"tool_choice": "auto"}, 400, "tool_choice", "tool_choice"),
    ({"parallel_tool_calls": False}, 400, "parallel_tool_calls", "parallel_tool_calls"),
    ({"store": True}, 400, "store", "store"),
    ({"metadata": {"a": "b"}}, 400, "metadata", "metadata"),
    ({"service_tier": "flex"}, 400, "service_tier", "service_tier"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "response_format"),
    ({"presence_penalty": 0.5}, 400, "penalties", "presence_penalty"),
    ({"top_logprobs": 2}, 400, "needs logprobs", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "between 0 and 20", "top_logprobs"),
    ({"logprobs": 3}, 400, "logprobs", "logprobs"),
    ({"stream_options": {"include_usage": True}}, 400, "only allowed when stream", "stream_options"),
    ({"logit_bias": 5}, 400, "logit_bias", "logit_bias"),
    ({"frobnicate": True}, 400, "Unrecognized request argument supplied: frobnicate", "frobnicate"),
    ({"stream": "yes"}, 400, "stream", "stream"),
    ({"temperature": "hot"}, 400, "temperature", "temperature"),
    ({"temperature": 3.5}, 400, "temperature", "temperature"),
    ({"top_p": 0}, 400, "top_p", "top_p"),
    ({"max_tokens": -1}, 400, "max_tokens must be at least 1", "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens must be at least 1", "max_tokens"),
    ({"max_tokens": 10 ** 12}, 400, "at most 256", "max_tokens"),
    ({"max_tokens": 1.5}, 400, "max_tokens", "max_tokens"),
    ({"max_completion_tokens": 257}, 400, "at most 256", "max_completion_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "stop"),
    ({"seed": "x"}, 400, "seed", "seed"),
    ({"stop": 7}, 400, "stop", "stop"),
    ({"model": "gpt-5"}, 404, "gpt-5", "model"),
]


@pytest.mark.parametrize("body,status,words,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_gets_an_openai_error(live_server, body, status, words, param):
    if isinstance(body, dict):     # a valid request with one thing wrong
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], **body})
    r = live_server.http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param
    assert err["type"] == ("invalid_request_error" if status in (400, 404) else err["type"])


def test_bad_input_through_the_official_client_and_server_keeps_serving(live_server):
    client = live_server.openai()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=TINY_MODEL_NAME, max_tokens=-5,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # a prompt longer than the context is refused with the sizes in the message
    long = "hello " * (live_server.service.max_model_len + 10)
    r = live_server.chat(long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert str(live_server.service.max_model_len - 1) in r.json()["error"]["message"]
    # bodies over the limit: declared, and sent without a declared length
    r = live_server.http.post("/v1/chat/completions", content=b"x" * (70 * 1024))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = live_server.http.post("/v1/chat/completions", content=iter([b"{" + b" " * (70 * 1024) + b"}"]))
    assert r.status_code == 413
    r = live_server.http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    ok = live_server.chat("Say hi.", max_tokens=3)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_full_queue_answers_429_with_retry_after(live_server, monkeypatch):
    """One request runs, one waits (max_num_seqs=1); with max_waiting=1 the third is turned away."""
    monkeypatch.setattr(live_server.service.config, "max_waiting", 1)
    before = live_server.engine()["max_num_seqs"]
    assert live_server.set_engine(max_num_seqs=1).status_code == 200
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    try:
        with live_server.http.stream("POST", "/v1/chat/completions", json=body) as first:
            lines = first.iter_lines()      # keep it: a dropped iterator closes the response
            next(lines)
            with live_server.http.stream("POST", "/v1/chat/completions", json=body) as second:
                assert second.status_code == 200
                deadline = time.monotonic() + 60
                while live_server.engine()["waiting"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                third = live_server.chat("hi")
                assert third.status_code == 429 and third.headers["retry-after"] == "2"
                assert third.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert live_server.set_engine(max_num_seqs=before).status_code == 200
    deadline = time.monotonic() + 60
    while live_server.engine()["live_requests"]:
        assert time.monotonic() < deadline, "closing the streams did not abort their requests"
        time.sleep(0.05)


def test_non_streaming_client_that_hangs_up_aborts_its_request(live_server):
    before = live_server.engine()["requests_aborted"]
    body = json.dumps({"messages": [{"role": "user", "content": "Count."}], "max_tokens": 200,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", live_server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while not live_server.engine()["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while (state := live_server.engine())["requests_aborted"] == before or state["live_requests"]:
        assert time.monotonic() < deadline, "the request outlived its client"
        time.sleep(0.05)
    assert state["kv"]["used"] == 0 and state["output_tokens"] > 0


def test_prefix_caching_and_the_kv_cap_switch_live_and_bad_values_are_named(live_server):
    """POST /api/engine turns prefix caching off and on and caps the KV blocks in use; the policy event
    and GET /api/engine say so; a bad value is a 400 naming the setting, and changes nothing."""
    total = live_server.engine()["kv"]["total"]
    try:
        r = live_server.set_engine(enable_prefix_caching=False, max_kv_blocks=total // 2)
        assert r.status_code == 200, r.text
        state = live_server.engine()
        assert state["enable_prefix_caching"] is False and state["max_kv_blocks"] == total // 2
        assert state["kv"]["limit"] == total // 2 and state["kv"]["cached"] == 0
        event = [x for x in live_server.records() if x["type"] == "policy"][-1]
        assert event["enable_prefix_caching"] is False and event["max_kv_blocks"] == total // 2
        system = {"role": "system", "content": "You answer in one word. " * 12}
        for _ in range(2):
            body = {"messages": [system, {"role": "user", "content": "Colour of the sky?"}], "max_tokens": 2}
            assert live_server.http.post("/v1/chat/completions", json=body).status_code == 200
        assert live_server.engine()["kv"]["cached"] == 0          # nothing published while off
        for bad, words in (({"max_kv_blocks": 0}, "max_kv_blocks must be an integer from 1"),
                           ({"max_kv_blocks": total + 1}, f"to the {total} blocks allocated"),
                           ({"enable_prefix_caching": "no"}, "enable_prefix_caching")):
            r = live_server.set_engine(**bad)
            assert r.status_code in (400, 422) and words in r.text, (bad, r.text)
        assert live_server.engine()["max_kv_blocks"] == total // 2
        assert live_server.set_engine(max_kv_blocks=4).status_code == 200   # 64 tokens, at 16 a block
        r = live_server.chat("Count.", max_tokens=200)
        assert r.status_code == 400 and "capped at 4 blocks (max_kv_blocks)" in r.text, r.text
    finally:
        assert live_server.set_engine(enable_prefix_caching=True, max_kv_blocks=None).status_code == 200
    assert live_server.engine()["max_kv_blocks"] is None and "limit" not in live_server.engine()["kv"]
