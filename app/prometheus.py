"""Prometheus metrics for GET /metrics, built from the engine's records with prometheus_client.

Where a number means what a vLLM metric means it has vLLM's name (and its
`model_name` label), so a Grafana dashboard made for vLLM shows batchscope:

    vllm:num_requests_running / _waiting   gauges, after each step
    vllm:kv_cache_usage_perc               KV blocks in use / all blocks (0..1)
    vllm:num_preemptions_total             sequences preempted (their KV freed, recomputed later)
    vllm:prompt_tokens_total               prompt tokens of requests that produced their first token
    vllm:generation_tokens_total           tokens sampled
    vllm:iteration_tokens_total            histogram: tokens in one forward pass (one step)
    vllm:prefix_cache_queries_total        prompt tokens looked up in the prefix cache ...
    vllm:prefix_cache_hits_total           ... and of those, found there
    vllm:request_success_total             finished requests, by finished_reason (stop, length)
    vllm:time_to_first_token_seconds       histogram: first token time - arrival (TTFT)
    vllm:inter_token_latency_seconds       histogram: gap between consecutive tokens of a request (TBT)
    vllm:e2e_request_latency_seconds       histogram: finish time - arrival (end to end)

batchscope's own, by scheduling policy:

    batchscope:steps_total{policy}          engine steps
    batchscope:stall_seconds_total{policy}  time running replies spent left out of a step: each step adds
                                            its duration once per reply it stalled (the record's `stalled`)

Everything is observed on the engine thread from the record stream (plus, for
a finished request, its token times); prometheus_client is thread-safe, so a
scrape on the event loop reads it without asking the engine anything.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
TBT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480, 960, 1920)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.engine = None
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running set", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)", m, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that started replying",
                                     m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens sampled", m, registry=r)
        self.step_tokens = Histogram("vllm:iteration_tokens_total", "Tokens in one engine step", m,
                                     buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     m, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             m, buckets=TBT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", m,
                             buckets=E2E_BUCKETS, registry=r)
        p = ["model_name", "policy"]
        self.steps = Counter("batchscope:steps", "Engine steps, by scheduling policy", p, registry=r)
        self.stall = Counter("batchscope:stall_seconds", "Seconds running replies spent left out of a step",
                             p, registry=r)

    def attach(self, engine, model_name: str):
        """Engine thread, once loaded: the engine whose finished requests give their token times."""
        self.engine, self.model = engine, model_name
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.labels(model_name).set(0)

    def observe(self, obj: dict):
        """Engine thread: one record or request event."""
        if self.engine is None:
            return
        if obj.get("type") == "step":
            self._step(obj)
        elif obj.get("type") == "request":
            self._request(obj)

    def _step(self, rec: dict):
        m = self.model
        self.running.labels(m).set(rec["running"])
        self.waiting.labels(m).set(rec["waiting"])
        kv = rec["kv"]
        self.kv_usage.labels(m).set(kv["used"] / kv["total"] if kv["total"] else 0.0)
        self.preemptions.labels(m).inc(len(rec["preempted"]))
        sampled = sum(1 for i in rec["items"] if i["kind"] == "decode" or i.get("completes_prompt"))
        self.generation_tokens.labels(m).inc(sampled)
        if rec["items"]:
            self.step_tokens.labels(m).observe(rec["num_tokens"])
        self.steps.labels(m, rec["policy"]).inc()
        self.stall.labels(m, rec["policy"]).inc((rec["t_end"] - rec["t_start"]) * len(rec.get("stalled", ())))

    def _request(self, ev: dict):
        m, event = self.model, ev["event"]
        if event == "first_token":
            seq = self.engine.get_request(ev["req"])
            self.ttft.labels(m).observe(ev["ttft"])
            self.prompt_tokens.labels(m).inc(seq.prompt_len)
            self.cache_queries.labels(m).inc(seq.prompt_len)
            self.cache_hits.labels(m).inc(seq.num_cached_tokens)
        elif event == "finished":
            seq = self.engine.get_request(ev["req"])
            self.success.labels(m, ev["finish_reason"]).inc()
            times = seq.token_times
            for a, b in zip(times, times[1:]):
                self.tbt.labels(m).observe(b - a)
            self.e2e.labels(m).observe(seq.finish_time - seq.arrival_time)
