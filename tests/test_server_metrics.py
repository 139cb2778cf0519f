"""GET /metrics: scraped and parsed with prometheus_client's own parser, checked against the records."""
from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_for

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

VLLM_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:iteration_tokens_total",
              "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
              "vllm:request_success"]


def scrape(live_server) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one scrape."""
    r = live_server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert set(VLLM_NAMES + ["batchscope:steps", "batchscope:stall_seconds"]) <= families.keys()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_metrics_add_up_to_the_replies_and_the_records(live_server):
    model = live_server.service.model_name
    wait_for(lambda: live_server.engine()["live_requests"] == 0, what="the requests of earlier tests to end")
    head = max([r["step"] for r in live_server.records(1) if r["type"] == "step"], default=-1)
    before = scrape(live_server)
    doc = "Here is a report about lighthouses and the sea. " * 12
    replies = {}

    def ask(name, content, n):
        replies[name] = live_server.chat(content, max_tokens=n, user=name, ignore_eos=True).json()
    # the same long prompt twice in a row: the second finds its blocks in the prefix cache
    ask("first", doc + "Summarise it.", 3)
    threads = [threading.Thread(target=ask, args=(name, doc + f"Summarise it, {name}.", n))
               for name, n in (("Ana", 5), ("Ben", 7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = scrape(live_server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    usages = [r["usage"] for r in replies.values()]
    assert total(delta, "vllm:generation_tokens_total", model_name=model) == sum(u["completion_tokens"] for u in usages)
    assert total(delta, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert total(delta, "vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert total(delta, "vllm:prefix_cache_hits_total") == hits > 0
    assert total(delta, "vllm:request_success_total", finished_reason="length") == 3
    assert total(delta, "vllm:time_to_first_token_seconds_count") == 3
    assert total(delta, "vllm:e2e_request_latency_seconds_count") == 3
    assert total(delta, "vllm:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    steps = [r for r in live_server.records() if r["type"] == "step" and r["step"] > head]
    assert total(delta, "batchscope:steps_total") == len(steps)
    assert total(delta, "batchscope:steps_total", policy="chunked") == len(steps)
    assert total(delta, "vllm:iteration_tokens_total_sum") == sum(r["num_tokens"] for r in steps)
    stall = sum((r["t_end"] - r["t_start"]) * len(r["stalled"]) for r in steps)
    assert total(delta, "batchscope:stall_seconds_total") == pytest.approx(stall, abs=1e-6)
    assert total(delta, "vllm:num_preemptions_total") == sum(len(r["preempted"]) for r in steps)
    # gauges: the server is idle again
    assert total(after, "vllm:num_requests_running") == total(after, "vllm:num_requests_waiting") == 0
    assert 0 <= total(after, "vllm:kv_cache_usage_perc") <= 1


SPEC_NAMES = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
              "vllm:spec_decode_num_accepted_tokens_total"]


def test_speculative_decoding_is_a_live_setting_and_its_counters_add_up(live_server):
    """POST /api/engine turns n-gram speculation on (vLLM's form) and off; the policy event carries it;
    /metrics' spec-decode families (vLLM's names) add up to the records' drafted and accepted counts."""
    model = live_server.service.model_name
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    for bad, words in [({"speculative_config": {**spec, "lookup": 2}}, "'lookup'"),
                       ({"speculative_config": {**spec, "method": "eagle"}}, "'method'"),
                       ({"speculative_config": "ngram"}, "speculative_config"),
                       ({"policy": "disaggregated", "speculative_config": spec}, "disaggregated pair")]:
        r = live_server.set_engine(**bad)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (bad, r.text)
    assert live_server.engine()["policy"] == "chunked" and live_server.engine()["disaggregated"] is None
    wait_for(lambda: live_server.engine()["live_requests"] == 0, what="the requests of earlier tests to end")
    head = max([r["step"] for r in live_server.records(1) if r["type"] == "step"], default=-1)
    before = scrape(live_server)
    try:
        r = live_server.set_engine(speculative_config=spec)
        assert r.status_code == 200 and r.json()["speculative_config"] == spec
        assert live_server.engine()["speculative_config"]["num_speculative_tokens"] == 3
        # the tiny random model repeats itself within 64 tokens: some drafts are kept
        usages = [live_server.chat(text, max_tokens=64, user=name, ignore_eos=True).json()["usage"]
                  for name, text in (("Ana", "one two three one two three one two three " * 3), ("Ben", "a a a a a"))]
    finally:
        off = live_server.set_engine(speculative_config=None)
    assert off.status_code == 200 and off.json()["speculative_config"] is None
    after = scrape(live_server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    records = [r for r in live_server.records() if r.get("step", -1) > head or r["type"] == "request"]
    events = [r for r in records if r["type"] == "policy" and r["step"] > head]
    assert events[0]["speculative_config"]["num_speculative_tokens"] == 3 and events[-1]["speculative_config"] is None
    items = [it for r in records if r["type"] == "step" and r["step"] > head for it in r["items"] if it.get("drafted")]
    assert items, "the tiny model's loops gave no draft: nothing was verified"
    drafted, accepted = sum(it["drafted"] for it in items), sum(it["accepted"] for it in items)
    assert 0 < accepted < drafted, (accepted, drafted)         # drafts kept and drafts rejected
    assert [total(delta, n, model_name=model) for n in SPEC_NAMES] == [len(items), drafted, accepted]
    per_pos = [total(delta, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] == sum(1 for it in items if it["accepted"] >= 1)
    # a verified decode's accepted tokens are output tokens like any other
    assert total(delta, "vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 128
    assert total(delta, "vllm:inter_token_latency_seconds_count") == 126
