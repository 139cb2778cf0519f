"""LLMEngine: requests in, one StepRecord per forward pass out.

    engine = LLMEngine(EngineConfig(policy="chunked"))
    rid = engine.add_request(messages=[{"role": "user", "content": "Hi"}], label="Alice")
    while engine.has_unfinished():
        record = engine.step()          # the StepRecord of docs/step_record.md
    engine.get_request(rid).output_text

Single-threaded by design: a server calls it from one engine thread.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import replace

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.loader import check_architecture, resolve_model
from engine.model_runner import ModelRunner
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
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer, folder)
        self.detokenizer = Detokenizer(self.tokenizer)
        # ---- scheduling ----
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.policy, config.max_num_batched_tokens,
                                   config.max_num_seqs, config.max_prefill_chunk)
        # ---- requests, records, counters ----
        self.requests: dict[str, Sequence] = {}              # live
        self.done: OrderedDict[str, Sequence] = OrderedDict()  # finished or aborted, newest last
        self.max_done = 4096
        self.listeners: list = []
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
        given = [x is not None for x in (prompt, messages, prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt must be a non-empty string")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif messages is not None:
            _check_messages(messages)
            if not self.tokenizer.chat_template:
                raise ValueError(f"model {self.model_name!r} has no chat template; send a plain prompt")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        else:
            ids = prompt_token_ids
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt_token_ids must be a non-empty list of ids in [0, {self.vocab_size})")
            ids = list(ids)
        if not ids:
            raise ValueError("prompt is empty after tokenisation")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the limit is {self.max_model_len - 1} "
                             f"(model context {self.max_model_len})")
        return ids

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
        self._end(seq, Status.ABORTED, "abort")
        seq.error = reason
        self.counters["requests_aborted"] += 1
        self._emit_request(seq, "aborted", reason=reason)
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
        self._emit({"type": "policy", "step": self.step_index, "t": self.clock(), **self.settings()})

    def settings(self) -> dict:
        s = self.scheduler
        return {"policy": s.policy, "max_num_batched_tokens": s.token_budget, "max_num_seqs": s.max_num_seqs,
                "max_prefill_chunk": s.max_prefill_chunk}

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> dict:
        return {**self.settings(), "model": self.model_name, "device": self.device,
                "dtype": self.config.dtype, "attention_backend": self.runner.backend.name,
                "max_model_len": self.max_model_len, "kv": self._kv(),
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "live_requests": len(self.requests), "step": self.step_index,
                "prefix_cache_hit_tokens": self.block_manager.num_hit_tokens, **self.counters}

    # ---- listeners: every StepRecord and request event goes to each ----
    def subscribe(self, fn):
        self.listeners.append(fn)

    def unsubscribe(self, fn):
        if fn in self.listeners:
            self.listeners.remove(fn)

    def _emit(self, obj: dict):
        for fn in list(self.listeners):
            try:
                fn(obj)
            except Exception:
                log.exception("a step listener failed; it is removed")
                self.unsubscribe(fn)

    def _emit_request(self, seq: Sequence, event: str, **extra):
        if self.listeners:
            self._emit({"type": "request", "event": event, "req": seq.id, "label": seq.label,
                        "t": self.clock(), **extra})

    # ---- the step ----
    def step(self) -> dict | None:
        """Schedule, run one forward pass, update every request in it. None when idle."""
        if not self.scheduler.has_work():
            return None
        t_start = self.clock()
        batch = self.scheduler.schedule()
        in_batch = {id(s) for s, _ in batch.items}
        stalled = [s.id for s in self.scheduler.running if s.is_prefill_done and id(s) not in in_batch]
        items = [self._item(seq, n) for seq, n in batch.items]
        for seq in batch.preempted:
            self.counters["preemptions"] += 1
            self._emit_request(seq, "preempted", step=self.step_index)
        t_sched = self.clock()
        finished = self._run(batch) if batch.items else []
        t_fwd = self.clock()
        record = {"type": "step", "step": self.step_index, "t_start": t_start, "t_end": t_fwd,
                  "policy": self.scheduler.policy, "token_budget": self.scheduler.token_budget,
                  "max_num_seqs": self.scheduler.max_num_seqs, "items": items,
                  "num_tokens": batch.num_tokens, "finished": finished,
                  "preempted": [s.id for s in batch.preempted], "stalled": stalled, "kv": self._kv(),
                  "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running)}
        record["timing"] = {"schedule": t_sched - t_start, "forward": t_fwd - t_sched,
                            "record": self.clock() - t_fwd}
        self.step_index += 1
        self.counters["steps"] += 1
        self._emit(record)
        return record

    def _item(self, seq: Sequence, n: int) -> dict:
        start = seq.num_computed_tokens
        if seq.is_prefill_done:
            return {"req": seq.id, "label": seq.label, "kind": "decode", "tokens": n, "start": start}
        item = {"req": seq.id, "label": seq.label, "kind": "prefill", "tokens": n, "start": start,
                "prompt_len": seq.num_tokens, "completes_prompt": start + n == seq.num_tokens}
        if seq.num_cached_tokens and start == seq.num_cached_tokens:
            item["cached"] = seq.num_cached_tokens
        return item

    def _run(self, batch: Batch) -> list[str]:
        try:
            tokens = iter(self.runner.run(batch))
        except Exception as e:      # one bad step fails the requests in it, not the engine
            log.exception("forward pass failed")
            for seq, _ in batch.items:
                self._fail(seq, f"forward pass failed: {type(e).__name__}: {e}")
            return []
        now, finished = self.clock(), []
        for seq, n in batch.items:
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue                                    # a prefill chunk that did not finish the prompt
            token = next(tokens)
            if token is None:
                self._fail(seq, "the model produced non-finite logits")
            elif self._append_token(seq, token, now):
                finished.append(seq.id)
        return finished

    def _append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Add a sampled token; True when it ends the request."""
        seq.output_token_ids.append(token)
        seq.token_times.append(now)
        self.counters["output_tokens"] += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._emit_request(seq, "first_token", ttft=now - seq.arrival_time)
        p = seq.params
        reason = None
        if self.detokenizer.update(seq):
            reason = "stop"
        elif (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        self.detokenizer.update(seq, final=True)
        self._end(seq, Status.FINISHED, reason)
        self.counters["requests_finished"] += 1
        self._emit_request(seq, "finished", finish_reason=reason, output_tokens=seq.num_output_tokens)
        return True

    def _fail(self, seq: Sequence, message: str):
        self._end(seq, Status.ABORTED, "error")
        seq.error = message
        self.counters["requests_failed"] += 1
        self._emit_request(seq, "aborted", reason=message)

    def _end(self, seq: Sequence, status: Status, reason: str):
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason, seq.finish_time = status, reason, self.clock()
        self.requests.pop(seq.id, None)
        self.done[seq.id] = seq
        while len(self.done) > self.max_done:
            self.done.popitem(last=False)

    def _kv(self) -> dict:
        bm = self.block_manager
        return {"used": bm.num_used, "total": bm.num_blocks, "cached": bm.num_cached, "block_size": bm.block_size}

    # ---- offline batches ----
    def generate(self, prompts: list | None = None, params: SamplingParams | list | None = None,
                 messages: list[list[dict]] | None = None) -> list[dict]:
        """Run a batch to completion. prompts: strings or token-id lists; or messages: chat histories."""
        inputs = prompts if prompts is not None else messages
        kinds = "prompt" if prompts is not None else "messages"
        params_list = params if isinstance(params, list) else [params] * len(inputs)
        rids = []
        for x, p in zip(inputs, params_list):
            if kinds == "prompt" and isinstance(x, list):
                rids.append(self.add_request(prompt_token_ids=x, params=p))
            else:
                rids.append(self.add_request(**{kinds: x}, params=p))
        while any(not self.get_request(r).is_finished for r in rids):
            self.step()
        out = []
        for r in rids:
            seq = self.get_request(r)
            out.append({"id": r, "text": seq.output_text, "token_ids": list(seq.output_token_ids),
                        "finish_reason": seq.finish_reason, "error": seq.error})
        return out


def _check_messages(messages):
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string 'role' and a string 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"message role must be system, user or assistant, got {m['role']!r}")


def _eos_ids(hf_config, tokenizer, folder) -> set[int]:
    ids = set()
    for src in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids.update(src if isinstance(src, list) else [src] if src is not None else [])
    try:
        from transformers import GenerationConfig
        g = GenerationConfig.from_pretrained(folder).eos_token_id
        ids.update(g if isinstance(g, list) else [g] if g is not None else [])
    except Exception:
        pass
    return ids
