"""LLMEngine: requests in, one StepRecord per forward pass out.

    engine = LLMEngine(EngineConfig(policy="chunked"))
    rid = engine.add_request(messages=[{"role": "user", "content": "Hi"}], label="Alice")
    while engine.has_unfinished():
        record = engine.step()          # the StepRecord of docs/step_record.md
    engine.get_request(rid).output_text

Single-threaded by design: a server calls it from one engine thread. The engine
orchestrates: the scheduler picks the batch and does the bookkeeping after it,
the runner computes it, the records (engine/records.py) tell the world.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import replace

import torch

from engine.block_manager import BlockManager
from engine.config import DTYPES, EngineConfig
from engine.detokenizer import Detokenizer
from engine.loader import check_architecture, resolve_model
from engine.model_runner import ModelRunner
from engine.prompts import eos_ids, tokenize
from engine.records import KVState, Listeners, PolicyEvent, RequestEvent, read_batch, step_record
from engine.sampling_params import SamplingParams
from engine.scheduler import Batch, Scheduler
from engine.sequence import Sequence, Status

log = logging.getLogger("batchscope.engine")
_UNSET = object()


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = replace(config, **overrides) if config else EngineConfig(**overrides)
        self.config = config
        if config.cpu_threads and config.device == "cpu":
            # process-wide: on a busy small machine fewer threads wait less for each other
            torch.set_num_threads(config.cpu_threads)
        # ---- model, tokenizer, weights ----
        from transformers import AutoConfig, AutoTokenizer
        folder = resolve_model(config.model)
        hf_config = AutoConfig.from_pretrained(folder)
        check_architecture(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        max_len = min(config.max_model_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        self.runner = ModelRunner(config, hf_config, folder, max_len)
        # a sequence must fit in the cache on its own, or it could never be scheduled
        self.max_model_len = min(max_len, self.runner.num_blocks * config.block_size)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = eos_ids(hf_config, self.tokenizer, folder)
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer)
        # ---- scheduling ----
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.block_manager.log = []            # block changes, sent with each step record (the KV map)
        self.scheduler = Scheduler(self.block_manager, config.policy, config.max_num_batched_tokens,
                                   config.max_num_seqs, config.max_prefill_chunk)
        # ---- requests, records, counters ----
        self.requests: dict[str, Sequence] = {}              # live
        self.done: OrderedDict[str, Sequence] = OrderedDict()  # finished or aborted, newest last
        self.max_done = 4096
        self.listeners = Listeners()
        self.step_index = 0
        self._ids = itertools.count()
        self._rng = torch.Generator().manual_seed(config.seed)
        self.counters = dict(steps=0, requests_finished=0, requests_aborted=0, requests_failed=0,
                             preemptions=0, prompt_tokens=0, output_tokens=0)
        self.t0 = time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def device(self) -> str:
        return str(self.runner.device)

    @property
    def device_dtype(self) -> str:
        """`cpu/float32`: what a step's cost depends on besides its shape (the records carry it)."""
        return f"{self.runner.device.type}/{DTYPES[self.config.dtype]}"

    # ---- requests ----
    def add_request(self, prompt: str | None = None, messages: list[dict] | None = None,
                    prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                    label: str | None = None, request_id: str | None = None) -> str:
        ids = self.tokenize(prompt, messages, prompt_token_ids)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        rid = request_id or f"r{next(self._ids)}"
        if rid in self.requests or rid in self.done:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, str(label) if label is not None else rid, ids, params, self.clock())
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
            seq.generator = torch.Generator(self.runner.device).manual_seed(seed)
        self.requests[rid] = seq
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(ids)
        self._emit_request(seq, "arrived", prompt_len=len(ids), max_tokens=params.max_tokens)
        return rid

    def tokenize(self, prompt=None, messages=None, prompt_token_ids=None) -> list[int]:
        return tokenize(self.tokenizer, self.vocab_size, self.max_model_len, self.model_name,
                        prompt, messages, prompt_token_ids)

    def get_request(self, request_id: str) -> Sequence:
        seq = self.requests.get(request_id) or self.done.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return seq

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop a request and free its KV blocks. False if it had already ended."""
        seq = self.get_request(request_id)
        if seq.is_finished:
            return False
        self._abort(seq, "abort", reason)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- settings ----
    def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                   max_num_seqs: int | None = None, max_prefill_chunk=_UNSET):
        """Change the policy and budgets; takes effect at the next step. Nothing in flight is lost.
        None (or leaving an argument out) keeps the current value; max_prefill_chunk=None removes the cap."""
        s = self.scheduler
        keep = lambda new, old: old if new is None else new
        s.set_policy(keep(policy, s.policy), keep(max_num_batched_tokens, s.token_budget),
                     keep(max_num_seqs, s.max_num_seqs),
                     s.max_prefill_chunk if max_prefill_chunk is _UNSET else max_prefill_chunk)
        self.listeners.emit(PolicyEvent(self.step_index, self.clock(), **self.settings()))

    def settings(self) -> dict:
        return self.scheduler.settings()

    def stats(self) -> dict:
        return {**self.settings(), "model": self.model_name, "device": self.device,
                "dtype": self.config.dtype, "attention_backend": self.runner.backend.name,
                "max_model_len": self.max_model_len, "kv": KVState.of(self.block_manager).to_dict(),
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "live_requests": len(self.requests), "step": self.step_index,
                "prefix_cache_hit_tokens": self.block_manager.num_hit_tokens, **self.counters}

    # ---- listeners: every StepRecord and event goes to each, as a dict of its own ----
    def subscribe(self, fn):
        self.listeners.subscribe(fn)

    def unsubscribe(self, fn):
        self.listeners.unsubscribe(fn)

    def _emit_request(self, seq: Sequence, event: str, t: float | None = None, **extra):
        if self.listeners:
            self.listeners.emit(RequestEvent(event, seq.id, seq.label, self.clock() if t is None else t, **extra))

    # ---- the step ----
    def step(self) -> dict | None:
        """Schedule, run one forward pass, update every request in it. None when idle."""
        if not self.scheduler.has_work():
            return None
        t_start = self.clock()
        batch = self.scheduler.schedule()
        t_sched = self.clock()
        before = read_batch(batch, self.scheduler.running)
        for seq in batch.preempted:
            self.counters["preemptions"] += 1
            self._emit_request(seq, "preempted", t=t_sched, step=self.step_index)
        t_items = self.clock()
        finished, error = self._run(batch) if batch.items else ([], None)
        t_end = self.clock()
        record = step_record(self.step_index, self.scheduler, batch, before, finished, error,
                             (t_start, t_sched, t_items, t_end), self.clock, self.device_dtype)
        self.step_index += 1
        self.counters["steps"] += 1
        self.listeners.emit(record)
        return record.to_dict()

    def _run(self, batch: Batch) -> tuple[list[str], str | None]:
        """The forward pass and what follows it. Returns the finished request ids and, if the pass
        raised, the error's class name (the step's requests then fail; the engine goes on)."""
        try:
            tokens = self.runner.run(batch)
        except Exception as e:
            log.exception("forward pass failed")
            for seq, _ in batch.items:
                self._abort(seq, "error", f"forward pass failed: {type(e).__name__}: {e}")
            return [], type(e).__name__
        finished = []
        for seq, token in self.scheduler.update(batch, tokens, self.clock()):
            if token is None:      # its KV may hold NaN: zeroed, or attention's masked padding would pass it on
                self.runner.clear_blocks(self.block_manager.unpublished_blocks(seq))
                self._abort(seq, "error", "the model produced non-finite logits")
            elif self._after_token(seq):
                finished.append(seq.id)
        return finished, None

    def _after_token(self, seq: Sequence) -> bool:
        """Events and stop conditions for a token just appended; True when it ends the request."""
        self.counters["output_tokens"] += 1
        if seq.num_output_tokens == 1:
            self._emit_request(seq, "first_token", ttft=seq.first_token_time - seq.arrival_time)
        stop_string = self.detokenizer.update(seq)     # every token: it also extends the text
        reason = "stop" if stop_string else seq.stop_reason(self.eos_token_ids, self.max_model_len)
        if reason is None:
            return False
        self.detokenizer.update(seq, final=True)
        self._end(seq, Status.FINISHED, reason)
        self.counters["requests_finished"] += 1
        self._emit_request(seq, "finished", finish_reason=reason, output_tokens=seq.num_output_tokens)
        return True

    def _abort(self, seq: Sequence, finish_reason: str, message: str):
        """End seq early: `abort` (a client asked, message is its reason) or `error` (message says what failed)."""
        self._end(seq, Status.ABORTED, finish_reason)
        seq.error = message
        self.counters["requests_failed" if finish_reason == "error" else "requests_aborted"] += 1
        self._emit_request(seq, "aborted", reason=message)

    def _end(self, seq: Sequence, status: Status, reason: str):
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason, seq.finish_time = status, reason, self.clock()
        self.requests.pop(seq.id, None)
        self.done[seq.id] = seq
        while len(self.done) > self.max_done:
            self.done.popitem(last=False)

    # ---- offline batches ----
    def generate(self, prompts: list | None = None, params: SamplingParams | list | None = None,
                 messages: list[list[dict]] | None = None) -> list[dict]:
        """Run a batch to completion. prompts: strings or token-id lists; or messages: chat histories."""
        if prompts is None:
            inputs = [{"messages": m} for m in messages]
        else:
            inputs = [{"prompt_token_ids": x} if isinstance(x, list) else {"prompt": x} for x in prompts]
        params_list = params if isinstance(params, list) else [params] * len(inputs)
        rids = [self.add_request(**x, params=p) for x, p in zip(inputs, params_list)]
        while not all(self.get_request(r).is_finished for r in rids):
            self.step()
        seqs = [self.get_request(r) for r in rids]
        return [{"id": seq.id, "text": seq.output_text, "token_ids": list(seq.output_token_ids),
                 "finish_reason": seq.finish_reason, "error": seq.error} for seq in seqs]

