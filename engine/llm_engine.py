"""LLMEngine: requests in, one StepRecord per forward pass out.

    engine = LLMEngine(EngineConfig(policy="chunked"))
    rid = engine.add_request(messages=[{"role": "user", "content": "Hi"}], label="Alice")
    while engine.has_unfinished():
        out = engine.step()             # StepOutputs: out.record, the StepRecord of docs/step_record.md,
        for o in out.outputs:           # and each request's new output (engine/protocol.py)
            print(o.request_id, o.text, o.finish_reason)
    engine.get_request(rid).output_text

Single-threaded by design: a server calls it from one engine thread. The engine
orchestrates: the scheduler picks the batch and does the bookkeeping after it,
the runner computes it, the records (engine/outputs/records.py) tell the world, and
the request book (engine/outputs/requests.py) keeps the requests, counters and listeners.
It satisfies the `Engine` protocol of engine/protocol.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from engine.config import DTYPES, EngineConfig, check_budgets
from engine.execution.model_runner import ModelRunner
from engine.memory import resident_bytes
from engine.outputs.records import KVState, PolicyEvent, read_batch, step_record
from engine.outputs.requests import Detokenizer, RequestBook, RequestFront, StepCounter, StopCheck, eos_ids
from engine.protocol import StepOutputs
from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.ngram import SpeculativeConfig, propose
from engine.scheduling.policies import resolve
from engine.scheduling.scheduler import Batch, Scheduler
from engine.scheduling.sequence import Sequence, Status
from engine.weights.loader import check_architecture, resolve_model, tokenizer

log = logging.getLogger("batchscope.engine")
_UNSET = object()


class LLMEngine(RequestFront):
    def __init__(self, config: EngineConfig | None = None, steps: StepCounter | None = None, **overrides):
        """overrides: EngineConfig fields. steps: another engine's step counter, to number as one stream."""
        config = replace(config, **overrides) if config else EngineConfig(**overrides)
        self.config = config
        if config.cpu_threads and config.device == "cpu":
            # process-wide: on a busy small machine fewer threads wait less for each other
            torch.set_num_threads(config.cpu_threads)
        # ---- model, tokenizer, weights ----
        from transformers import AutoConfig
        folder = resolve_model(config.model)
        hf_config = AutoConfig.from_pretrained(folder)
        check_architecture(hf_config)
        self.tokenizer = tokenizer(folder)
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        max_len = min(config.max_model_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        self.runner = ModelRunner(config, hf_config, folder, max_len)
        # a sequence must fit in the cache on its own, or it could never be scheduled
        self.max_model_len = min(max_len, self.runner.num_blocks * config.block_size)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = eos_ids(hf_config, self.tokenizer, folder)
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.stop_check = StopCheck(self.detokenizer, self.eos_token_ids, self.max_model_len)
        # ---- scheduling ----
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.block_manager.log = []            # block changes, sent with each step record (the KV map)
        self.scheduler = Scheduler(self.block_manager, resolve(config.policy), config.max_num_batched_tokens,
                                   config.max_num_seqs, config.max_prefill_chunk)
        self.scheduler.max_model_len = self.max_model_len
        # ---- requests, records, counters ----
        self.t0 = time.perf_counter()
        # the book keeps no clock: each time is read here, from self.clock, which a caller may replace (the
        # what-if replay's stopwatch), and handed to the book
        self.book = RequestBook(self.detokenizer.token_text)
        self.counters = self.book.counters
        self.steps = steps or StepCounter()
        self._rng = torch.Generator().manual_seed(config.seed)
        self.speculative = config.speculative_config      # engine/scheduling/ngram.py; None: off

    @property
    def requests(self) -> dict[str, Sequence]:
        """The live requests by id (ended ones are in self.book.done)."""
        return self.book.live

    def share_clock(self, wall0: float):
        """Read the clock whose zero was at wall time wall0 (time.time()): another process's, so that
        both engines' times lie on one line (the disaggregated pair)."""
        self.t0 = time.perf_counter() - (time.time() - wall0)

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
        if isinstance(params, SamplingParams) or params is None:     # (the book names a wrong type)
            self.scheduler.check_fits(len(ids), (params or SamplingParams()).max_tokens)
        seq = self.book.admit(ids, params, label, request_id, self.clock())
        if not seq.params.greedy:
            p = seq.params
            seed = p.seed if p.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
            seq.generator = torch.Generator(self.runner.device).manual_seed(seed)
        self.scheduler.add(seq)
        self.book.arrived(seq)
        return seq.id

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop a request and free its KV blocks. False if it had already ended."""
        seq = self.get_request(request_id)
        if seq.is_finished:
            return False
        self._abort(seq, "abort", reason)
        return True

    # ---- a request moving between engines (the disaggregated pair's workers) ----
    def hold(self, seq: Sequence) -> bool:
        """Take a running request out of the schedule, keeping its KV blocks: its prompt is done here and
        another engine decodes it (until release(), an abort still frees it). False if it was not running."""
        if seq not in self.scheduler.running:
            return False
        self.scheduler.running.remove(seq)
        return True

    def release(self, seq: Sequence):
        """The request has left this engine: free its blocks (they stay prefix-cached) and forget it."""
        self.scheduler.remove(seq)
        self.book.hand_out(seq.id)

    def adopt(self, seq: Sequence):
        """A request whose KV is already in this engine's blocks (BlockManager.import_blocks) joins the
        schedule as a running decode; its outputs from here on are what it gains here."""
        seq.status, seq.last_scheduled = Status.RUNNING, -1
        self.book.take_in(seq)
        self.scheduler.running.append(seq)

    # ---- settings ----
    def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                   max_num_seqs: int | None = None, max_prefill_chunk=_UNSET, speculative_config=_UNSET,
                   enable_prefix_caching: bool | None = None, max_kv_blocks=_UNSET):
        """Change the policy, budgets, cache settings and speculative decoding; takes effect at the next step.
        Nothing in flight is lost. None (or leaving an argument out) keeps the current value;
        max_prefill_chunk=None removes the cap, max_kv_blocks=None gives back every block (Scheduler.set_cache),
        speculative_config=None turns speculation off (vLLM's dict form turns it on). All or nothing: a bad
        value changes nothing."""
        s = self.scheduler
        spec = self.speculative if speculative_config is _UNSET else SpeculativeConfig.of(speculative_config)
        keep = lambda new, old: old if new is None else new
        chosen = resolve(keep(policy, s.policy_object))
        budgets = (keep(max_num_batched_tokens, s.token_budget), keep(max_num_seqs, s.max_num_seqs),
                   s.max_prefill_chunk if max_prefill_chunk is _UNSET else max_prefill_chunk)
        check_budgets(*budgets)
        s.set_cache(enable_prefix_caching, "keep" if max_kv_blocks is _UNSET else max_kv_blocks)
        s.set_policy(chosen, *budgets)
        self.speculative = spec
        self.book.emit(PolicyEvent(self.step_index, self.clock(), **self.settings()))

    def reset_prefix_cache(self):
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache): later prompts find nothing cached;
        blocks held by running requests stay theirs."""
        self.block_manager.reset_prefix_cache()

    def settings(self) -> dict:
        spec = self.speculative
        return {**self.scheduler.settings(), "speculative_config": spec.to_dict() if spec else None}

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> dict:
        return {**self.settings(), "model": self.model_name, "device": self.device,
                "dtype": self.config.dtype, "attention_backend": self.runner.backend.name,
                "cuda_graphs": self.runner.graph_stats(),
                "max_model_len": self.max_model_len, "kv": KVState.of(self.block_manager).to_dict(),
                "waiting": self.num_waiting, "running": len(self.scheduler.running),
                "live_requests": len(self.book.live), "step": self.step_index,
                "prefix_cache_hit_tokens": self.block_manager.num_hit_tokens, "memory": self.memory(),
                **self.counters}

    def memory(self) -> dict:
        """This process's resident bytes and the KV cache's bytes (engine/memory.py)."""
        return {"rss_bytes": resident_bytes(), "kv_cache_bytes": self.runner.kv_cache_bytes}

    def _emit_request(self, seq: Sequence, event: str, t: float | None = None, **extra):
        self.book.emit_request(seq, event, self.clock() if t is None else t, **extra)

    # ---- the step ----
    def step(self) -> StepOutputs | None:
        """Schedule, run one forward pass, update every request in it. None when idle."""
        if not self.scheduler.has_work():
            return None
        t_start = self.clock()
        self._draft()
        batch = self.scheduler.schedule(t_start)      # the policy sees the time as a value: StepView.now
        t_sched = self.clock()
        before = read_batch(batch, self.scheduler.running)
        for seq in batch.preempted:
            self.counters["preemptions"] += 1
            self._emit_request(seq, "preempted", t=t_sched, step=self.step_index)
        t_items = self.clock()
        finished, error = self._run(batch) if batch.items else ([], None)
        t_end = self.clock()
        record = step_record(self.steps.take(), self.scheduler, batch, before, finished, error,
                             (t_start, t_sched, t_items, t_end), self.clock, self.device_dtype,
                             self.speculative.num_speculative_tokens if self.speculative else None)
        self.counters["steps"] += 1
        return StepOutputs(self.book.emit(record), self.book.take_outputs())

    def _draft(self):
        """Speculative decoding: each running reply's guess of its next tokens (engine/scheduling/ngram.py),
        never past its max_tokens or the model's context; the scheduler decides how many run."""
        spec = self.speculative
        for seq in self.scheduler.running:
            k = 0
            if spec is not None and seq.is_prefill_done:
                k = min(spec.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - seq.num_tokens)
            seq.draft_token_ids = (propose(seq.all_token_ids, k, spec.prompt_lookup_max, spec.prompt_lookup_min)
                                   if k > 0 else [])

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
        # the stop check runs after each token appended (a verified decode appends several); the ends wait
        # for the update to finish, in the order the tokens came
        appended = self.scheduler.update(batch, tokens, self.clock(), self.stop_check)
        finished = [seq.id for seq, token in appended if token is not None and self._after_token(seq)]
        for seq, token in appended:
            if token is None:      # its KV may hold NaN: zeroed, or attention's masked padding would pass it on
                self.runner.clear_blocks(self.block_manager.unpublished_blocks(seq))
                self._abort(seq, "error", "the model produced non-finite logits")
        return finished, None

    def _after_token(self, seq: Sequence) -> bool:
        """Events for a token the update appended, and the end the stop check found (at the request's first
        token of the step that ended it: the rest only count); True when it ends the request."""
        self.counters["output_tokens"] += 1
        if seq.num_output_tokens == 1:     # (a step that gives a reply its first token gives it only that one)
            self._emit_request(seq, "first_token", ttft=seq.first_token_time - seq.arrival_time)
        reason = self.stop_check.ended.pop(seq.id, None)
        if reason is None:
            return False
        self._end(seq, Status.FINISHED, reason)
        self._emit_request(seq, "finished", finish_reason=reason, output_tokens=seq.num_output_tokens)
        return True

    def _abort(self, seq: Sequence, finish_reason: str, message: str):
        """End seq early: `abort` (a client asked, message is its reason) or `error` (message says what failed)."""
        self._end(seq, Status.ABORTED, finish_reason, message)
        self._emit_request(seq, "aborted", reason=message, finish_reason=finish_reason)

    def _end(self, seq: Sequence, status: Status, reason: str, error: str | None = None):
        self.scheduler.remove(seq)
        self.book.end(seq, status, reason, error, self.clock())

    def close(self):
        """Nothing outlives the engine object: its memory goes with it (the Engine protocol asks for close)."""

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

