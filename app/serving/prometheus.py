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
    vllm:spec_decode_num_drafts_total      speculative decoding: decodes that verified drafts (one per reply
                                           and step, as vLLM counts a draft)
    vllm:spec_decode_num_draft_tokens_total    tokens drafted and verified
    vllm:spec_decode_num_accepted_tokens_total ... of those, kept in the reply
    vllm:spec_decode_num_accepted_tokens_per_pos_total  {position}: drafts kept at position 0, 1, ... of their
                                           draft (a draft is kept only if the ones before it were)

batchscope's own, by scheduling policy:

    batchscope:steps_total{policy}          engine steps
    batchscope:stall_seconds_total{policy}  time running replies spent left out of a step: each step adds
                                            its duration once per reply it stalled (the record's `stalled`)

Memory, read at each scrape (the service's memory(): engine/memory.py and the runner's kv_cache_bytes,
the numbers /healthz shows):

    process_resident_memory_bytes           this process's resident memory (prometheus_client's name; its
                                            process collector is not in this registry)
    batchscope:kv_cache_bytes               bytes of this process's KV cache tensors (vLLM has no such metric)
    batchscope:worker_resident_memory_bytes {worker}: each worker process of the disaggregated pair
    batchscope:worker_kv_cache_bytes        {worker}: its KV cache

Everything else is observed from the record stream alone (steps and request events), with
app/readers/metrics.py's definitions: a token's time is its step's end (TokenClock), so the TTFT
and TBT here are the page's. That is why the same class serves the own engine (engine thread) and
an attached vLLM (its lanes' threads, `engine` = the data-parallel lane); prometheus_client is
thread-safe, so a scrape on the event loop reads it without asking the engine anything.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from app.readers.metrics import TokenClock, phases

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TBT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)                       # also time per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")
ENGINE = "0"                                           # vLLM's engine label: one engine core (lane 0)


def buckets_1_2_5(top: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to top: vLLM's buckets for token counts (top = max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class _Request:
    """What the stream has said so far about one live request."""
    arrival: float
    prompt_len: int
    lane: str = ENGINE
    scheduled: float | None = None           # t_start of the first step that ran it
    times: list[float] = field(default_factory=list)   # its token times (the steps' ends)
    output_tokens: int | None = None         # set by its `finished` event


class MemoryCollector:
    """The memory gauges, from memory() at each scrape (see the module's docstring)."""

    def __init__(self, memory: Callable[[], dict], model: Callable[[], str | None]):
        self.memory, self.model = memory, model

    def describe(self):
        return []                                # not probed at registration: memory() needs a loaded engine

    def collect(self):
        mem = self.memory()
        model = self.model() or ""
        if mem.get("rss_bytes") is not None:
            yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes",
                                    value=mem["rss_bytes"])
        if mem.get("kv_cache_bytes") is not None:
            kv = GaugeMetricFamily("batchscope:kv_cache_bytes", "Bytes of this process's KV cache tensors",
                                   labels=["model_name", "engine"])
            kv.add_metric([model, ENGINE], mem["kv_cache_bytes"])
            yield kv
        workers = mem.get("workers") or {}
        rss = GaugeMetricFamily("batchscope:worker_resident_memory_bytes",
                                "Resident memory of each worker process of the disaggregated pair",
                                labels=["model_name", "worker"])
        kv = GaugeMetricFamily("batchscope:worker_kv_cache_bytes", "Bytes of each worker's KV cache tensors",
                               labels=["model_name", "worker"])
        for name, w in workers.items():
            if w.get("rss_bytes") is not None:
                rss.add_metric([model, name], w["rss_bytes"])
            if w.get("kv_cache_bytes") is not None:
                kv.add_metric([model, name], w["kv_cache_bytes"])
        if workers:
            yield rss
            yield kv


class Metrics:
    def __init__(self, memory: Callable[[], dict] | None = None):
        """memory(): the serving process's memory (EngineService.memory), read at each scrape."""
        self.registry = r = CollectorRegistry()
        if memory is not None:
            r.register(MemoryCollector(memory, lambda: self.model))
        self.model: str | None = None
        self.dtype = ""
        self.live: dict[str, _Request] = {}             # arrived, not yet ended (or ended, last token due)
        self.clock = TokenClock()
        self.lanes_seen: set[str] = set()                # lanes whose gauges are started
        self.caches_shown: set[str] = set()              # lanes whose cache_config_info is set
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
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Speculative decoding: drafts verified", m, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens",
                                    m, registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                       "Speculative decoding: draft tokens accepted", m, registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Speculative decoding: draft tokens accepted, by position in the draft",
                                        m + ["position"], registry=r)
        p = ["model_name", "policy"]
        self.steps = Counter("batchscope:steps", "Engine steps, by scheduling policy", p, registry=r)
        self.stall = Counter("batchscope:stall_seconds", "Seconds running replies spent left out of a step",
                             p, registry=r)

    def attach(self, model_name: str, max_model_len: int, dtype: str, kv: dict | None = None):
        """Once the engine is known: label every series with its model, make the length histograms
        (their buckets follow max_model_len) and start every request-end series at 0, as vLLM does."""
        self.model, self.dtype = model_name, str(dtype)
        self._lane(ENGINE, kv)                        # kv: the cache's block_size and total, where known
        for reason in FINISH_REASONS:
            self.success.labels(model_name, ENGINE, reason)
        for counter in (self.drafts, self.draft_tokens, self.accepted_tokens):
            counter.labels(model_name, ENGINE)
        if not self.lengths:
            top = buckets_1_2_5(max_model_len)
            for key, name, text in (("prompt", "vllm:request_prompt_tokens", "Prompt tokens of a finished request"),
                                    ("generation", "vllm:request_generation_tokens",
                                     "Output tokens of a finished request"),
                                    ("max_generation", "vllm:request_max_num_generation_tokens",
                                     "Most output tokens among a finished request's choices")):
                self.lengths[key] = Histogram(name, text, ["model_name", "engine"], buckets=top, registry=self.registry)

    def _lane(self, lane: str, kv: dict | None = None):
        """A lane's gauges from 0, and its cache's configuration once a record shows it."""
        m = self.model, lane
        if lane not in self.lanes_seen:
            self.lanes_seen.add(lane)
            for gauge in (self.running, self.waiting, self.kv_usage):
                gauge.labels(*m).set(0)
            for reason in ("capacity", "deferred"):
                self.waiting_by_reason.labels(*m, reason).set(0)
        if kv is not None and lane not in self.caches_shown:
            self.caches_shown.add(lane)
            self.cache_info.labels(str(kv["block_size"]), str(kv["total"]), self.dtype, lane).set(1)

    def observe(self, obj: dict):
        """One record or request event, in stream order (a step's request events come before it)."""
        if self.model is None:
            return
        if obj.get("type") == "step":
            self._step(obj)
        elif obj.get("type") == "request":
            self._request(obj)

    def _step(self, rec: dict):
        lane = str(rec.get("lane") or 0)
        m = self.model, lane
        self._lane(lane, rec["kv"])
        self.running.labels(*m).set(rec["running"])
        self.waiting.labels(*m).set(rec["waiting"])
        self.waiting_by_reason.labels(*m, "capacity").set(rec["waiting"])
        kv = rec["kv"]
        self.kv_usage.labels(*m).set(kv["used"] / kv["total"] if kv["total"] else 0.0)
        self.preemptions.labels(*m).inc(len(rec["preempted"]))
        if rec["items"]:
            self.step_tokens.labels(*m).observe(rec["num_tokens"])
        for item in rec["items"]:
            if item.get("drafted"):
                self._draft(m, item["drafted"], item.get("accepted") or 0)
            q = self.live.get(item["req"])
            if q is not None and q.scheduled is None:
                q.scheduled, q.lane = rec["t_start"], lane
                self.cache_queries.labels(*m).inc(q.prompt_len)
                self.cache_hits.labels(*m).inc(item.get("cached") or 0)
        new = self.clock.step(rec)
        self.generation_tokens.labels(*m).inc(len(new))
        for req, tk in new:
            q = self.live.get(req)
            if tk.gap is not None:
                self.tbt.labels(*m).observe(tk.gap)
            elif q is not None:
                self.ttft.labels(*m).observe(tk.t - q.arrival)
                self.prompt_tokens.labels(*m).inc(q.prompt_len)
            if q is not None:
                q.times.append(tk.t)
                if q.output_tokens is not None and len(q.times) >= q.output_tokens:
                    self._finished(req, q)
        self.steps.labels(self.model, rec["policy"]).inc()
        self.stall.labels(self.model, rec["policy"]).inc((rec["t_end"] - rec["t_start"]) * len(rec.get("stalled", ())))

    def _draft(self, m: tuple[str, str], drafted: int, accepted: int):
        self.drafts.labels(*m).inc()
        self.draft_tokens.labels(*m).inc(drafted)
        self.accepted_tokens.labels(*m).inc(accepted)
        for pos in range(drafted):                   # every position drafted is shown, from 0
            self.accepted_per_pos.labels(*m, str(pos)).inc(1 if pos < accepted else 0)

    def _request(self, ev: dict):
        event, req = ev["event"], ev["req"]
        if event == "arrived":
            self.live[req] = _Request(ev["t"], ev.get("prompt_len") or 0)
            return
        if event not in ("finished", "aborted"):
            return
        q = self.live.get(req)
        reason = ev.get("finish_reason") or ("abort" if event == "aborted" else "stop")
        self.success.labels(self.model, q.lane if q else ENGINE, reason).inc()
        if event == "aborted" or q is None:          # counted, not timed
            self._forget(req)
            return
        q.output_tokens = ev.get("output_tokens") or 0
        if len(q.times) >= q.output_tokens:          # its last token's step has been seen already
            self._finished(req, q)
        # else: its last token is in the step record that follows this event

    def _finished(self, req: str, q: _Request):
        m = self.model, q.lane
        self._forget(req)
        if not q.times:
            return
        self.e2e.labels(*m).observe(q.times[-1] - q.arrival)
        if q.scheduled is not None:
            ph = phases(q.arrival, q.scheduled, q.times)
            for hist, value in ((self.queue, ph.queue), (self.prefill, ph.prefill), (self.decode, ph.decode),
                                (self.inference, ph.inference), (self.tpot, ph.tpot)):
                if value is not None:
                    hist.labels(*m).observe(value)
        if self.lengths:
            self.lengths["prompt"].labels(*m).observe(q.prompt_len)
            self.lengths["generation"].labels(*m).observe(len(q.times))
            self.lengths["max_generation"].labels(*m).observe(len(q.times))

    def _forget(self, req: str):
        self.live.pop(req, None)
        self.clock.forget(req)
