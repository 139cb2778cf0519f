"""Prometheus metrics for GET /metrics, built from the engine's records with prometheus_client.

Where a number means what a vLLM metric means it has vLLM's name, labels
(`model_name`, `engine`) and buckets, so vLLM's Grafana dashboards show batchscope:

    vllm:num_requests_running / _waiting   gauges, after each step
    vllm:num_requests_waiting_by_reason    {reason}: capacity (every waiting request here waits for room:
                                           budget, sequence slots or KV blocks), deferred (always 0)
    vllm:kv_cache_usage_perc               KV blocks in use / all blocks (0..1)
    vllm:cache_config_info                 1, labelled with the cache's block_size, num_gpu_blocks, cache_dtype
    vllm:num_preemptions_total             sequences preempted (their KV freed, recomputed later)
    vllm:prompt_tokens_total               prompt tokens of requests that produced their first token
    vllm:generation_tokens_total           tokens sampled
    vllm:iteration_tokens_total            histogram: tokens in one forward pass (one step)
    vllm:prefix_cache_queries_total        prompt tokens looked up in the prefix cache ...
    vllm:prefix_cache_hits_total           ... and of those, found there
    vllm:request_success_total             ended requests, by finished_reason (stop, length, abort, error)
    vllm:time_to_first_token_seconds       histogram: first token time - arrival (TTFT)
    vllm:inter_token_latency_seconds       histogram: gap between consecutive tokens of a request (TBT)
    vllm:e2e_request_latency_seconds       histogram: finish time - arrival (end to end)
    vllm:request_queue_time_seconds        histograms of a finished request's phases (app/readers/metrics.py
    vllm:request_prefill_time_seconds        `phases`): waiting, first scheduled -> first token,
    vllm:request_decode_time_seconds         first -> last token, first scheduled -> last token,
    vllm:request_inference_time_seconds      and decode / (tokens - 1)
    vllm:request_time_per_output_token_seconds
    vllm:request_prompt_tokens             histograms of a finished request's prompt and reply lengths;
    vllm:request_generation_tokens           max_num_generation_tokens is the reply's length too (each
    vllm:request_max_num_generation_tokens   choice of n is a request of its own here)

batchscope's own, by scheduling policy:

    batchscope:steps_total{policy}          engine steps
    batchscope:stall_seconds_total{policy}  time running replies spent left out of a step: each step adds
                                            its duration once per reply it stalled (the record's `stalled`)

Everything is observed on the engine thread from the record stream (plus, for
a request that ends, its token times); prometheus_client is thread-safe, so a
scrape on the event loop reads it without asking the engine anything.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.readers.metrics import phases

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TBT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)                       # also time per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")
ENGINE = "0"                                           # vLLM's engine label: one engine core


def buckets_1_2_5(top: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to top: vLLM's buckets for token counts (top = max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.engine = None
        self.scheduled: dict[str, float] = {}           # live request -> t_start of the first step that ran it
        self.ended: list[tuple] = []                     # (request, finished?) ended since the last record
        m = ["model_name", "engine"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running set", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", m, registry=r)
        self.waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Waiting requests, by why they wait",
                                       m + ["reason"], registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)", m, registry=r)
        self.cache_info = Gauge("vllm:cache_config_info", "The KV cache's configuration",
                                ["block_size", "num_gpu_blocks", "cache_dtype", "engine"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that started replying",
                                     m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens sampled", m, registry=r)
        self.step_tokens = Histogram("vllm:iteration_tokens_total", "Tokens in one engine step", m,
                                     buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     m, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", m, registry=r)
        self.success = Counter("vllm:request_success", "Ended requests, by finish reason", m + ["finished_reason"],
                               registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             m, buckets=TBT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", m,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        phase = lambda name, text: Histogram(name, text, m, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = phase("vllm:request_queue_time_seconds", "Arrival to first scheduled")
        self.prefill = phase("vllm:request_prefill_time_seconds", "First scheduled to first token")
        self.decode = phase("vllm:request_decode_time_seconds", "First token to last token")
        self.inference = phase("vllm:request_inference_time_seconds", "First scheduled to last token")
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Decode time / (output tokens - 1)",
                              m, buckets=TBT_BUCKETS, registry=r)
        self.lengths: dict[str, Histogram] = {}           # made at attach: their buckets follow max_model_len
        p = ["model_name", "policy"]
        self.steps = Counter("batchscope:steps", "Engine steps, by scheduling policy", p, registry=r)
        self.stall = Counter("batchscope:stall_seconds", "Seconds running replies spent left out of a step",
                             p, registry=r)

    def attach(self, engine, model_name: str):
        """Engine thread, once loaded: the engine whose ended requests give their token times
        (get_request) and whose stats() give the cache's configuration."""
        self.engine, self.model = engine, model_name
        stats = getattr(engine, "engine", engine).stats()   # the service's EngineLoop, or an LLMEngine
        labels = (model_name, ENGINE)
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.labels(*labels).set(0)
        for reason in ("capacity", "deferred"):
            self.waiting_by_reason.labels(*labels, reason).set(0)
        for reason in FINISH_REASONS:                   # every series from the start, as vLLM does
            self.success.labels(*labels, reason)
        kv = stats["kv"]
        self.cache_info.labels(str(kv["block_size"]), str(kv["total"]), str(stats["dtype"]), ENGINE).set(1)
        if not self.lengths:
            top = buckets_1_2_5(stats["max_model_len"])
            for key, name, text in (("prompt", "vllm:request_prompt_tokens", "Prompt tokens of a finished request"),
                                    ("generation", "vllm:request_generation_tokens", "Output tokens of a finished request"),
                                    ("max_generation", "vllm:request_max_num_generation_tokens",
                                     "Most output tokens among a finished request's choices")):
                self.lengths[key] = Histogram(name, text, ["model_name", "engine"], buckets=top, registry=self.registry)

    def observe(self, obj: dict):
        """Engine thread: one record or request event."""
        if self.engine is None:
            return
        if obj.get("type") == "step":
            self._step(obj)
        elif obj.get("type") == "request":
            self._request(obj)

    def _step(self, rec: dict):
        m = self.model, ENGINE
        self.running.labels(*m).set(rec["running"])
        self.waiting.labels(*m).set(rec["waiting"])
        self.waiting_by_reason.labels(*m, "capacity").set(rec["waiting"])
        kv = rec["kv"]
        self.kv_usage.labels(*m).set(kv["used"] / kv["total"] if kv["total"] else 0.0)
        self.preemptions.labels(*m).inc(len(rec["preempted"]))
        sampled = sum(1 for i in rec["items"] if i["kind"] == "decode" or i.get("completes_prompt"))
        self.generation_tokens.labels(*m).inc(sampled)
        if rec["items"]:
            self.step_tokens.labels(*m).observe(rec["num_tokens"])
        for item in rec["items"]:
            self.scheduled.setdefault(item["req"], rec["t_start"])
        for seq, finished in self.ended:    # a step's request events come before its record: time them now
            scheduled = self.scheduled.pop(seq.id, None)
            if finished:
                self._finished(seq, scheduled)
        self.ended.clear()
        self.steps.labels(self.model, rec["policy"]).inc()
        self.stall.labels(self.model, rec["policy"]).inc((rec["t_end"] - rec["t_start"]) * len(rec.get("stalled", ())))

    def _request(self, ev: dict):
        m, event = (self.model, ENGINE), ev["event"]
        if event == "first_token":
            seq = self.engine.get_request(ev["req"])
            self.ttft.labels(*m).observe(ev["ttft"])
            self.prompt_tokens.labels(*m).inc(seq.prompt_len)
            self.cache_queries.labels(*m).inc(seq.prompt_len)
            self.cache_hits.labels(*m).inc(seq.num_cached_tokens)
        elif event == "finished":
            seq = self.engine.get_request(ev["req"])
            self.success.labels(*m, ev["finish_reason"]).inc()
            times = seq.token_times
            for a, b in zip(times, times[1:]):
                self.tbt.labels(*m).observe(b - a)
            self.e2e.labels(*m).observe(seq.finish_time - seq.arrival_time)
            self.ended.append((seq, True))
        elif event == "aborted":                # counted, not timed
            seq = self.engine.get_request(ev["req"])
            self.success.labels(*m, seq.finish_reason or "abort").inc()
            self.scheduled.pop(seq.id, None)    # between steps; in a step, the record below re-adds it:
            self.ended.append((seq, False))     # so drop it again after that record

    def _finished(self, seq, scheduled: float | None):
        m = self.model, ENGINE
        if scheduled is not None and seq.token_times:
            ph = phases(seq.arrival_time, scheduled, seq.token_times)
            for hist, value in ((self.queue, ph.queue), (self.prefill, ph.prefill), (self.decode, ph.decode),
                                (self.inference, ph.inference), (self.tpot, ph.tpot)):
                if value is not None:
                    hist.labels(*m).observe(value)
        if self.lengths:
            self.lengths["prompt"].labels(*m).observe(seq.prompt_len)
            self.lengths["generation"].labels(*m).observe(seq.num_output_tokens)
            self.lengths["max_generation"].labels(*m).observe(seq.num_output_tokens)
