"""A vLLM v1 scheduler that records each step as a batchscope StepRecord.

    vllm serve MODEL --scheduler-cls integrations.vllm.RecordingScheduler      (scheduler.py picks the base)

The subclass calls vLLM's own methods unchanged and only reads around them:
  add_request        -> an `arrived` event
  schedule()         -> reads the running queue before, the SchedulerOutput after: the step's
                        items, stalls with their causes, preemptions (reading.py)
  update_from_output -> the step's end: each decode's drafted and accepted tokens (read just before
                        vLLM's method, as it counts them), tokens produced (`first_token`), finished
                        requests, the KV cache and queue sizes after it; the record is published
  finish_requests    -> `aborted` events (a client that went away)
Records go to a Publisher (publisher.py) and to any listener added with `recording.listeners`.
The step loop only builds the frozen records; turning them into JSON is the publisher thread's work.

Times are wall-clock seconds (time.time()), so the lanes of several engines share one clock;
the app attached to them rebases them to its own start. With async scheduling vLLM schedules
step N+1 before it processes step N's output, so consecutive steps' [t_start, t_end] overlap.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from engine.outputs.records import Listeners, PolicyEvent, RequestEvent, StepRecord, StepTiming
from integrations.vllm import reading

log = logging.getLogger("batchscope.vllm")
DEFAULT_RECORDS_PORT = 8765     # engine with data-parallel rank r listens on this + r
MAX_PENDING = 16                # steps scheduled and not yet processed (async scheduling keeps 1-2)


class Recording:
    """The recorder's state for one engine: step counter, labels, steps scheduled but not yet updated."""

    def __init__(self, sched: Any, engine: str):
        self.sched, self.engine = sched, engine
        self.listeners = Listeners()            # in-process readers (tests): each gets a dict of its own
        self.publisher = None                   # the socket (start_publishing): gets the Record itself
        self.step = 0
        self.labels: dict[str, str] = {}
        self.arrival: dict[str, float] = {}     # live request -> its arrival time
        self.produced: dict[str, int] = {}      # live request -> reply tokens published
        self.pending: dict[int, tuple] = {}     # id(SchedulerOutput) -> (it, what schedule() read)
        cfg = sched.vllm_config
        sc, par = cfg.scheduler_config, cfg.parallel_config
        # the engine's data-parallel rank: data_parallel_index, which vLLM keeps when it runs the engines of a
        # dense model as independent ones (it then sets data_parallel_size to 1 and data_parallel_rank to 0 in
        # each engine process); None for the one engine of a server without data parallelism
        index = par.data_parallel_index
        self.lane = index if par.data_parallel_size > 1 or index > 0 else None
        self.lanes = par.data_parallel_size     # the engines, where vLLM still says (a MoE model); else 1
        self.budget = min(sched.max_num_scheduled_tokens, sc.max_num_batched_tokens)
        self.policy = "chunked" if sc.enable_chunked_prefill else "continuous"
        self.device = f"{cfg.device_config.device_type}/{str(cfg.model_config.dtype).replace('torch.', '')}"
        self.prefix_caching = bool(cfg.cache_config.enable_prefix_caching)
        spec = cfg.speculative_config
        self.speculative = spec.num_speculative_tokens if spec is not None and spec.num_speculative_tokens else None
        self.settings = {"policy": self.policy, "max_num_batched_tokens": self.budget,
                         "max_num_seqs": sched.max_num_running_reqs,
                         "max_prefill_chunk": sc.long_prefill_token_threshold or None,
                         "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
                         "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
                         "async_scheduling": bool(sc.async_scheduling),
                         "speculative_config": speculative_setting(spec),
                         "block_size": sched.block_size}

    def hello(self) -> dict:
        cfg = self.sched.vllm_config
        name = str(cfg.model_config.served_model_name)
        return {"type": "hello", "engine": self.engine, "lane": self.lane or 0, "lanes": self.lanes,
                "model": os.path.basename(name.rstrip("/")),      # never a machine path
                "max_model_len": cfg.model_config.max_model_len,
                "device": self.device, "settings": self.settings, "time": time.time()}

    def emit(self, record):
        if self.publisher is not None:
            self.publisher.publish(record)      # serialised on the publisher's thread, not here
        if self.listeners:
            self.listeners.emit(record)

    def policy_event(self) -> PolicyEvent:
        s = self.settings
        return PolicyEvent(self.step, time.time(), s["policy"], s["max_num_batched_tokens"], s["max_num_seqs"],
                           s["max_prefill_chunk"], engine=self.engine)

    # ---- the hooks ----
    def arrived(self, req: Any):
        label = self.labels[req.request_id] = reading.label_of(req.request_id)
        self.arrival[req.request_id] = req.arrival_time
        sp = req.sampling_params
        self.emit(RequestEvent("arrived", req.request_id, label, req.arrival_time, prompt_len=req.num_prompt_tokens,
                               max_tokens=sp.max_tokens if sp is not None else None))

    def scheduled(self, out: Any, before: dict[str, bool], t_start: float, t_sched: float):
        if not out.num_scheduled_tokens and not out.preempted_req_ids:
            return                                          # an idle turn of the loop: no step
        items = reading.read_items(out, self.sched.requests, before, self.labels)
        stalled, causes = reading.read_stalls(out, before, self.budget)
        preempted = tuple(sorted(out.preempted_req_ids or ()))
        for rid in preempted:
            self.emit(RequestEvent("preempted", rid, self.labels.get(rid) or reading.label_of(rid), t_sched,
                                   step=self.step))
        self.pending[id(out)] = (out, (self.step, items, stalled, causes, preempted, t_start, t_sched, time.time()))
        self.step += 1
        while len(self.pending) > MAX_PENDING:          # outputs vLLM never processed (an empty step at shutdown)
            del self.pending[next(iter(self.pending))]

    def updated(self, out: Any, outputs: dict, drafts: dict[str, tuple[int, int]] | None = None):
        entry = self.pending.pop(id(out), None)
        if entry is None or entry[0] is not out:         # id() of an output long gone, reused
            return
        step, items, stalled, causes, preempted, t_start, t_sched, t_items = entry[1]
        t_end = time.time()
        items = reading.with_drafts(items, drafts or {})
        finished = []
        for eco in outputs.values():
            for o in eco.outputs:
                rid = o.request_id
                if o.new_token_ids and not self.produced.get(rid):
                    self._first_token(rid, t_end)
                self.produced[rid] = self.produced.get(rid, 0) + len(o.new_token_ids)
                if o.finish_reason is not None:
                    finished.append(rid)
                    self._finished(rid, str(o.finish_reason), t_end)
        s = self.sched
        running, waiting = s.get_request_counts()
        rec = StepRecord(
            step=step, t_start=t_start, t_end=t_end, policy=self.policy, token_budget=self.budget,
            max_num_seqs=s.max_num_running_reqs, items=items, num_tokens=out.total_num_scheduled_tokens,
            finished=tuple(finished), preempted=preempted, stalled=stalled, stall_causes=causes,
            kv=reading.read_kv(s.kv_cache_manager.block_pool, s.block_size), waiting=waiting, running=running,
            failed=False, device=self.device, lane=self.lane, lane_step=step if self.lane is not None else None,
            speculative=self.speculative, prefix_caching=None if self.prefix_caching else False,
            timing=StepTiming(schedule=t_sched - t_start, items=t_items - t_sched, forward=t_end - t_items,
                              record=time.time() - t_end))
        self.emit(rec)

    def aborted(self, reqs: list[Any]):
        t = time.time()
        for req in reqs:
            if req.status.name == "FINISHED_ABORTED":
                rid = req.request_id
                self.emit(RequestEvent("aborted", rid, self.labels.get(rid) or reading.label_of(rid), t,
                                       reason="aborted by the client", finish_reason="abort"))
                self._forget(rid)

    def _first_token(self, rid: str, t: float):
        arrival = self.arrival.get(rid)
        ttft = t - arrival if arrival is not None else None
        self.emit(RequestEvent("first_token", rid, self.labels.get(rid) or reading.label_of(rid), t, ttft=ttft))

    def _finished(self, rid: str, reason: str, t: float):
        self.emit(RequestEvent("finished", rid, self.labels.get(rid) or reading.label_of(rid), t,
                               finish_reason=reason.lower(), output_tokens=self.produced.get(rid, 0)))
        self._forget(rid)

    def _forget(self, rid: str):
        for state in (self.labels, self.arrival, self.produced):
            state.pop(rid, None)


def speculative_setting(spec: Any) -> dict | None:
    """vLLM's speculative config in the form `--speculative-config` takes (None: off); n-gram's lookup
    window with it."""
    if spec is None or not spec.num_speculative_tokens:
        return None
    out = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        out |= {"prompt_lookup_max": spec.prompt_lookup_max, "prompt_lookup_min": spec.prompt_lookup_min}
    return out


def start_publishing(rec: Recording):
    """Publish rec's records at BATCHSCOPE_RECORDS_HOST:BATCHSCOPE_RECORDS_PORT + lane (defaults
    127.0.0.1:8765); BATCHSCOPE_RECORDS_PORT=off records for local listeners only."""
    from integrations.vllm.publisher import Publisher
    port = os.environ.get("BATCHSCOPE_RECORDS_PORT", str(DEFAULT_RECORDS_PORT))
    if port == "off":
        return None
    host = os.environ.get("BATCHSCOPE_RECORDS_HOST", "127.0.0.1")
    base = int(port)
    pub = rec.publisher = Publisher(host, base + (rec.lane or 0) if base else 0, rec.hello())
    log.info("batchscope: step records of this engine at tcp://%s:%d", pub.host, pub.port)
    return pub


def engine_name() -> str:
    """The engine a recording names in its hello: `vllm <version>`."""
    import vllm
    return f"vllm {vllm.__version__}"


class StepRecorder:
    """Mixin over vLLM's Scheduler or AsyncScheduler: the hooks, around vLLM's own methods."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recording = Recording(self, engine_name())
        self.publisher = start_publishing(self.recording)
        if self.publisher is not None:
            self.publisher.hello = self.recording.hello()
        self.recording.emit(self.recording.policy_event())

    def add_request(self, request) -> None:
        super().add_request(request)
        if request.request_id in self.requests and request.request_id not in self.recording.labels:
            self.recording.arrived(request)

    def schedule(self, *args, **kwargs):
        t_start = time.time()
        before = reading.read_before(self.running)
        out = super().schedule(*args, **kwargs)
        self.recording.scheduled(out, before, t_start, time.time())
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        drafts = reading.read_drafts(scheduler_output, model_runner_output, self.requests,
                                     self.num_sampled_tokens_per_step)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.recording.updated(scheduler_output, outputs, drafts)
        return outputs

    def finish_requests(self, request_ids, finished_status):
        reqs = super().finish_requests(request_ids, finished_status)
        self.recording.aborted(reqs or [])
        return reqs

    def shutdown(self) -> None:
        super().shutdown()
        if self.publisher is not None:
            self.publisher.close()
