"""Property-based fuzzing of the HTTP API and the step stream: every malformed input gets a 4xx
with a message, nothing gets a 5xx, and the server stays healthy for everyone else: afterwards it gives
the same greedy reply, token for token, as before the fuzzing (on the tiny random model)."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.server

json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "", 3]),
                                 "content": json_values})
chat_body = st.fixed_dictionaries({}, optional={
    "model": json_values, "messages": st.lists(message, max_size=3) | json_values,
    "max_tokens": st.integers(-5, 10**7) | json_values, "temperature": st.floats(-5, 500) | json_values,
    "top_p": st.floats(-1, 2) | json_values, "stream": st.booleans() | json_values,
    "stop": json_values, "seed": json_values, "n": json_values, "surprise": json_values})
completion_body = st.fixed_dictionaries({}, optional={
    "model": json_values, "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 60000), max_size=4) | json_values,
    "max_tokens": st.integers(-5, 10**7) | json_values, "logprobs": st.integers(-2, 30) | json_values,
    "n": st.integers(-1, 10) | json_values, "echo": json_values, "stream": st.booleans() | json_values,
    "stop": json_values, "seed": json_values, "best_of": json_values, "surprise": json_values})
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
seen = {"cases": 0}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module", autouse=True)
def reply_before_fuzzing(live_server) -> dict:
    r = live_server.chat(QUESTION, max_tokens=10)
    assert r.status_code == 200
    return r.json()


def check(r):
    seen["cases"] += 1
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and isinstance(err["message"], str)


@SETTINGS
@given(body=chat_body)
def test_chat_completions_fuzz(live_server, body):
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"]:
        body["max_tokens"] = min(body["max_tokens"], 4)        # valid bodies stay cheap to serve
    check(live_server.http.post("/v1/chat/completions", json=body))


@SETTINGS
@given(body=completion_body)
def test_completions_fuzz(live_server, body):
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"]:
        body["max_tokens"] = min(body["max_tokens"], 4)        # valid bodies stay cheap to serve
    check(live_server.http.post("/v1/completions", json=body))


@SETTINGS
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_chat_completions_raw_bytes(live_server, raw):
    check(live_server.http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}))


@SETTINGS
@given(body=json_values)
def test_engine_settings_fuzz(live_server, body):
    before = live_server.engine()
    r = live_server.http.post("/api/engine", json=body, headers={"X-Presenter-Key": live_server.key})
    check(r)
    if r.status_code >= 400:   # a rejected change changes nothing
        after = live_server.engine()
        assert (after["policy"], after["max_num_batched_tokens"]) == \
            (before["policy"], before["max_num_batched_tokens"])


def test_websocket_garbage_gets_errors_and_the_stream_goes_on(live_server):
    from websockets.sync.client import connect
    with connect(live_server.ws, open_timeout=30) as ws:
        ws.recv(timeout=30)                                      # the snapshot
        for garbage in ["{", "null", "[1,2]", json.dumps({"type": "nope"}), "x" * 3000, "\x00\xff"]:
            ws.send(garbage)
        live_server.chat("Say hi.", max_tokens=2)
        kinds = set()
        for _ in range(200):
            msg = json.loads(ws.recv(timeout=60))
            kinds.add(msg.get("type"))
            if "step" in kinds and "error" in kinds:
                break
        assert "step" in kinds and "error" in kinds


def test_server_is_healthy_after_fuzzing(live_server, reply_before_fuzzing):
    assert live_server.http.get("/healthz").status_code == 200
    r = live_server.chat(QUESTION, max_tokens=10)
    want = reply_before_fuzzing["choices"][0]["message"]["content"]
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want and want
    now, before = r.json()["usage"], reply_before_fuzzing["usage"]
    assert (now["prompt_tokens"], now["completion_tokens"]) == (before["prompt_tokens"], 10)
    state = live_server.engine()
    assert state["kv"]["used"] == 0 or state["live_requests"] > 0
