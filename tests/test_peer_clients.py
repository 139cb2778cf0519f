"""What the field's benchmark clients (guidellm, aiperf, vllm bench serve) send and probe, on a real server:
/health, HEAD /metrics, /v1/models' root and max_model_len, vLLM's sampling extensions and
stream_options.continuous_usage_stats; and a field that is not supported stays a 400 naming it.
min_tokens, ignore_eos and the repetition penalty need a model that ends its replies by itself and repeats
itself: they run on the real default model (real_server); the rest on the tiny random one (live_server)."""
import json

import pytest

pytestmark = pytest.mark.server


def test_health_and_metrics_probes(live_server):
    assert live_server.http.get("/health").status_code == 200
    head = live_server.http.head("/metrics")
    assert head.status_code == 200 and head.headers["content-type"].startswith("text/plain") and head.content == b""


def test_models_names_root_and_context(live_server):
    (model,) = live_server.http.get("/v1/models").json()["data"]
    assert model["root"] == model["id"] == live_server.service.model_name
    assert model["max_model_len"] == live_server.service.max_model_len > 0


def test_min_tokens_holds_off_the_end(real_server):
    short = real_server.chat("Reply with one word: yes or no?", max_tokens=40).json()
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 20
    longer = real_server.chat("Reply with one word: yes or no?", max_tokens=40, min_tokens=n + 10).json()
    assert longer["usage"]["completion_tokens"] >= n + 10


def test_ignore_eos_and_skip_special_tokens(real_server):
    body = dict(max_tokens=20, ignore_eos=True)        # a reply that ends by itself well before that
    shown = real_server.chat("Reply with one word: yes or no?", **body, skip_special_tokens=False).json()
    hidden = real_server.chat("Reply with one word: yes or no?", **body).json()
    assert shown["usage"]["completion_tokens"] == hidden["usage"]["completion_tokens"] == 20
    assert "<|im_end|>" in shown["choices"][0]["message"]["content"]
    assert "<|im_end|>" not in hidden["choices"][0]["message"]["content"]


def test_repetition_penalty_and_min_p_are_applied(real_server):
    prompt = "Repeat the word 'cat' twenty times."
    plain = real_server.chat(prompt, max_tokens=16).json()["choices"][0]["message"]["content"]
    penalised = real_server.chat(prompt, max_tokens=16, repetition_penalty=1.8).json()
    assert penalised["choices"][0]["message"]["content"] != plain
    # min_p = 1 keeps only the most likely token: sampling at any temperature is then greedy
    hot = real_server.chat(prompt, max_tokens=12, temperature=1.5, min_p=1.0, seed=3).json()
    greedy = real_server.chat(prompt, max_tokens=12).json()
    assert hot["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_continuous_usage_stats(live_server):
    body = {"prompt": "Count to ten:", "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with live_server.http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] > 0 for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6
    assert chunks[-1]["choices"] == []


@pytest.mark.parametrize("extra, param", [
    ({"min_p": 1.5}, "min_p"), ({"min_tokens": 99, "max_tokens": 8}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"stream": True, "stream_options": {"include_usage": True, "per_token": True}}, "stream_options.per_token"),
    ({"best_of_n": 2}, "best_of_n"), ({"presence_penalty": 0.5}, "presence_penalty")])
def test_unsupported_or_bad_fields_are_a_400_naming_them(live_server, extra, param):
    r = live_server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
