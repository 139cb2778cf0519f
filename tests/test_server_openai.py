"""OpenAI completeness, through the official `openai` client against the real loopback server:
n, stop, seed, logprobs, max_completion_tokens, include_usage, cached_tokens, /v1/completions."""
from __future__ import annotations

import json

import openai
import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]
ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
LONG = "Here is a report about lighthouses, their keepers and the sea. " * 10


def test_n_choices_are_seeded_per_choice_and_stream_like_the_whole_reply(live_server):
    client = live_server.openai()
    kw = dict(model=live_server.service.model_name, messages=ASK, n=3, seed=7, temperature=1.0, max_tokens=8)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1, "every choice sampled with the same seed"
    assert (3 <= a.usage.completion_tokens <= 3 * 8
            and a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens)
    streamed = {0: "", 1: "", 2: ""}
    finish = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == texts
    assert finish == {i: c.finish_reason for i, c in enumerate(a.choices)}


def test_stop_and_max_completion_tokens(live_server):
    client = live_server.openai()
    full = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=30,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    word = full.split()[2]
    cut = client.chat.completions.create(messages=ASK, temperature=0, max_tokens=30, stop=[word], model=None)
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].message.content
    assert full.startswith(cut.choices[0].message.content)
    capped = client.chat.completions.create(messages=ASK, temperature=0, max_completion_tokens=3, model=None,
                                            extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


def test_logprobs_with_top_logprobs(live_server):
    client = live_server.openai()
    r = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    tokens = choice.logprobs.content
    assert len(tokens) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in tokens) == choice.message.content
    for t in tokens:
        top = [x.logprob for x in t.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and all(x <= 0 for x in top)
        # greedy: the chosen token is the most likely one
        assert t.token == t.top_logprobs[0].token and t.logprob == pytest.approx(top[0])
        assert bytes(t.bytes).decode() == t.token
    plain = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=6,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content
    only = client.chat.completions.create(model=None, messages=ASK, temperature=0, max_tokens=2, logprobs=True)
    assert all(t.top_logprobs == [] for t in only.choices[0].logprobs.content)


def test_cached_tokens_report_prefix_cache_hits_and_include_usage_streams_them(live_server):
    client = live_server.openai()
    block = live_server.engine()["kv"]["block_size"]
    ask = [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarise."}]
    first = client.chat.completions.create(model=None, messages=ask, temperature=0, max_tokens=2)
    chunks = list(client.chat.completions.create(model=None, messages=ask, temperature=0, max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 2
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= usage.prompt_tokens and cached % block == 0
    assert cached >= first.usage.prompt_tokens - 2 * block      # all full blocks of the prompt but the last
    assert all(c.usage is None for c in chunks[:-1])


def test_text_completions_streamed_and_not(live_server):
    client = live_server.openai()
    prompt = "The capital of France is"
    whole = client.completions.create(model=live_server.service.model_name, prompt=prompt, max_tokens=6,
                                      temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) <= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    pieces = list(client.completions.create(model=None, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == choice.text
    assert pieces[-1].usage.completion_tokens == 6
    ids = client.completions.create(model=None, prompt=[504, 3458, 282], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens >= 1
    default = client.completions.create(model=None, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16               # OpenAI's default max_tokens for completions


@pytest.mark.parametrize("body,param", [
    ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"), ({"n": 9}, "n"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"logit_bias": {"1": 2}}, "logit_bias"), ({"messages": []}, "messages"),
    ({"frequency_penalty": 1}, "frequency_penalty"), ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_completions_reject_what_they_do_not_support_by_name(live_server, body, param):
    r = live_server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_the_official_client_sees_a_400_naming_the_field(live_server):
    client = live_server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=None, messages=ASK, max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=None, prompt="Hi", max_tokens=2, echo=True)
    assert e.value.body["param"] == "echo"
    assert json.loads(live_server.http.get("/healthz").text)["status"] == "ok"
