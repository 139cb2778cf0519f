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
