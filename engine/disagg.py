"""DisaggregatedEngine: prompts on one engine, replies on another, the KV cache handed over between them.

    engine = DisaggregatedEngine(EngineConfig(policy="disaggregated"))
    rid = engine.add_request(messages=[{"role": "user", "content": "Hi"}], label="Alice")
    while engine.has_unfinished():
        record = engine.step()          # the next StepRecord of either worker; record["worker"] says which
    engine.get_request(rid).output_text
    engine.close()

The fourth generation of LLM serving (DistServe, Splitwise, Mooncake): two worker
processes, each an LLMEngine with its own share of the cores and its own KV cache.

  prefill worker  runs prompts (in chunks under its token budget) up to and including
                  the first token; then copies the request's KV, block by block, into a
                  staging area in shared memory and frees its own blocks.
  decode worker   adopts the request (prompt + first token; its KV copied from the
                  staging area into blocks of its own) and decodes it to the end.
  router (here)   assigns requests, relays records and request events, forwards an
                  abort to whichever worker holds the request, and restarts a worker
                  process that dies: its requests fail with the reason, the other
                  worker's go on.

Both workers run the `chunked` scheduler; their step records say `policy:
"disaggregated"` and carry `worker`. The router numbers the records of both in the
order it relays them (`step`, unique as under one engine; `worker_step` is the
worker's own count), and each worker's clock is set to the router's at start, so
all times lie on one time line. A `kv_transfer`
request event tells each hand-over (blocks, bytes, seconds).

step() is the pump of a driver loop: it relays what the workers published and
returns their next step record, waiting for one while requests are in flight (as
LLMEngine.step waits for its forward pass), and returns None when none is.
"""
from __future__ import annotations

import copy
import itertools
import logging
import multiprocessing as mp
import os
import queue
import time
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from multiprocessing.shared_memory import SharedMemory

from engine.config import DTYPES, EngineConfig, check_budgets
from engine.llm_engine import LLMEngine
from engine.records import KVState, PolicyEvent, RequestEvent, kv_ops
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, Status

log = logging.getLogger("batchscope.disagg")
WORKERS = ("prefill", "decode")
_UNSET = object()


# ================= the worker process =================
@dataclass(frozen=True)
class Staging:
    """The shared-memory area KV blocks cross: (slots, layers, 2, block_size, kv_heads, head_dim)."""
    name: str
    shape: tuple[int, ...]
    dtype: str                       # torch dtype name

    def attach(self):
        import torch
        shm = SharedMemory(self.name)
        numel = 1
        for n in self.shape:
            numel *= n
        return shm, torch.frombuffer(shm.buf, dtype=getattr(torch, self.dtype), count=numel).view(self.shape)


class Worker:
    """One LLMEngine in a process of its own, running the router's commands between its steps."""

    def __init__(self, name: str, config: EngineConfig, staging: Staging, busy_slots: list[int],
                 wall0: float, commands: mp.Queue, results: mp.Queue):
        self.name, self.commands, self.results = name, commands, results
        self.engine = e = LLMEngine(config)
        import torch
        self.threads = torch.get_num_threads()
        e.t0 = time.perf_counter() - (time.time() - wall0)      # e.clock() now reads the router's clock
        self.shm, self.staging = staging.attach()
        self.free_slots = deque(s for s in range(staging.shape[0]) if s not in set(busy_slots))  # prefill
        self.outbox: list[Sequence] = []     # prefill: first token out, waiting for staging slots
        self.inbox: list[tuple[Sequence, list[int], float]] = []   # decode: handed over, waiting for blocks
        self.sent: dict[str, tuple[int, int]] = {}   # request -> (tokens, characters) already sent
        self.out: list[dict] = []            # records and events since the last send
        e.subscribe(self._keep)

    def _keep(self, obj: dict):
        if obj["type"] == "policy" or (obj["type"] == "request" and obj["event"] == "arrived"):
            return                           # the router publishes these, once for both workers
        if obj["type"] == "step":
            obj["worker"], obj["policy"], obj["threads"] = self.name, "disaggregated", self.threads
        self.out.append(obj)

    def run(self):
        e = self.engine
        self.results.put(("ready", {"pid": os.getpid(), "threads": self.threads,
                                    "num_blocks": e.block_manager.num_blocks, "max_model_len": e.max_model_len,
                                    "device": e.device, "attention_backend": e.runner.backend.name,
                                    "bytes_per_block": e.runner.bytes_per_block}))
        while True:
            # idle: sleep until the router says something; busy: take what has come and step
            cmd = self._next(block=not e.scheduler.has_work())
            while cmd is not None:
                if cmd[0] == "stop":
                    self.results.cancel_join_thread()    # exit now, whether or not the router reads on
                    return
                getattr(self, "do_" + cmd[0])(*cmd[1:])
                cmd = self._next(block=False)
            if e.scheduler.has_work():
                e.step()
            self._send()
            self._export() if self.name == "prefill" else self._import()

    def _next(self, block: bool):
        try:
            return self.commands.get(block)
        except queue.Empty:
            return None

    def _send(self):
        """The records and events of the last step and commands, with the requests' new tokens and text."""
        if not self.out:
            return
        touched = {i["req"] for o in self.out if o["type"] == "step" for i in o["items"]}
        touched |= {o["req"] for o in self.out if o["type"] == "request"}
        updates = {}
        for rid in touched & set(self.sent):
            seq = self.engine.get_request(rid)
            updates[rid] = self._progress(seq)
            if seq.is_finished:
                del self.sent[rid]
            elif self.name == "prefill" and seq.is_prefill_done and seq in self.engine.scheduler.running:
                self.engine.scheduler.running.remove(seq)    # its first token is out: the decode worker goes on
                self.outbox.append(seq)
        self.results.put(("out", self.out, updates))
        self.out = []

    def _progress(self, seq: Sequence) -> dict:
        n, c = self.sent[seq.id]
        self.sent[seq.id] = (seq.num_output_tokens, len(seq.output_text))
        return {"tokens": seq.output_token_ids[n:], "times": seq.token_times[n:], "text": seq.output_text[c:],
                "logprobs": seq.logprobs[n:], "first_token_time": seq.first_token_time,
                "num_cached_tokens": seq.num_cached_tokens, "num_preemptions": seq.num_preemptions,
                "status": seq.status, "finish_reason": seq.finish_reason, "finish_time": seq.finish_time,
                "error": seq.error}

    # ---- prefill worker ----
    def do_add(self, request: dict, arrival: float):
        rid = self.engine.add_request(**request)
        self.engine.get_request(rid).arrival_time = arrival     # when the router took it
        self.sent[rid] = (0, 0)

    def do_release(self, slots: list[int]):
        self.free_slots.extend(slots)

    def _export(self):
        """Hand over, oldest first, each prompt done whose blocks fit in the free staging slots."""
        e, bm = self.engine, self.engine.block_manager
        self.outbox = [s for s in self.outbox if not s.is_finished]      # aborted while waiting
        while self.outbox and len(bm.export_blocks(self.outbox[0])) <= len(self.free_slots):
            seq = self.outbox.pop(0)
            t0, blocks = e.clock(), bm.export_blocks(seq)
            slots = [self.free_slots.popleft() for _ in blocks]
            e.runner.copy_blocks_out(blocks, self.staging, slots)
            e.scheduler.remove(seq)                  # frees its blocks (they stay prefix-cached here)
            ops = kv_ops(bm)                         # those frees: sent with the hand-over, not with a later step
            del e.requests[seq.id], self.sent[seq.id]
            generator, seq.generator = seq.generator, None
            state = generator.get_state() if generator is not None else None
            self.results.put(("exported", seq.id, seq, state, slots, t0, ops))

    # ---- decode worker ----
    def do_adopt(self, seq: Sequence, generator_state, slots: list[int], t0: float):
        if generator_state is not None:
            import torch
            seq.generator = torch.Generator(self.engine.runner.device)
            seq.generator.set_state(generator_state)
        self.inbox.append((seq, slots, t0))

    def _import(self):
        """Adopt, oldest first, each handed-over request its blocks fit in this cache."""
        e = self.engine
        while self.inbox:
            seq, slots, t0 = self.inbox[0]
            blocks = e.block_manager.import_blocks(seq, seq.num_computed_tokens)
            if blocks is None:
                return                               # the cache is full: wait for a reply to end
            e.runner.copy_blocks_in(self.staging, slots, blocks)
            self.inbox.pop(0)
            seq.status, seq.last_scheduled = Status.RUNNING, -1
            e.requests[seq.id] = seq
            e.scheduler.running.append(seq)
            self.sent[seq.id] = (seq.num_output_tokens, len(seq.output_text))
            self.results.put(("imported", seq.id, slots, t0, e.clock()))

    # ---- both ----
    def do_abort(self, rid: str, reason: str):
        for item in self.inbox:
            if item[0].id == rid:                    # not adopted yet: only its staging slots to give back
                self.inbox.remove(item)
                self.results.put(("dropped", rid, item[1]))
                return
        try:
            self.engine.abort(rid, reason)           # frees its blocks, in the cache or the outbox
        except KeyError:
            pass                                     # already handed over, or never arrived
        self.sent.pop(rid, None)

    def do_settings(self, budgets: dict):
        self.engine.set_policy("chunked", **budgets)

    def do_ask(self, key: int):
        bm = self.engine.block_manager
        self.results.put(("reply", key, {"free": bm.num_free, "total": bm.num_blocks,
                                         "staging_free": len(self.free_slots), "live": len(self.engine.requests),
                                         "inbox": len(self.inbox), "outbox": len(self.outbox)}))

    def do_pause(self, seconds: float):
        time.sleep(seconds)                          # tests: hold a request in the middle of a hand-over


def _worker_main(*args):
    Worker(*args).run()
    os._exit(0)      # nothing left to flush; skips seconds of interpreter teardown of torch and the model


# ================= the router, in the caller's process =================
@dataclass
class Handle:
    """A worker process as the router sees it."""
    name: str
    process: mp.Process
    commands: mp.Queue
    results: mp.Queue
    restarts: int = 0
    info: dict | None = None                 # its ready message: pid, threads, blocks; None while loading
    last: dict | None = None                 # its newest step record


@dataclass
class Transfer:
    slots: list[int]
    t0: float                                # export started (router clock)
    kv_ops: tuple = ()                       # the prefill worker's frees of the hand-over


@dataclass
class _Router:
    holder: dict[str, str] = field(default_factory=dict)          # live request -> the worker holding it
    transfers: dict[str, Transfer] = field(default_factory=dict)  # exported, not yet adopted
    ended: set[str] = field(default_factory=set)                  # requests the router itself ended


class DisaggregatedEngine:
    def __init__(self, config: EngineConfig | None = None, transfer_blocks: int | None = None,
                 load_timeout: float = 300.0, t0: float | None = None, **overrides):
        config = replace(config, **overrides) if config else EngineConfig(**overrides)
        self.config = config = replace(config, policy="disaggregated")
        from transformers import AutoConfig, AutoTokenizer
        from engine.loader import resolve_model
        from engine.models.llama import head_dim_of
        folder = resolve_model(config.model)
        hf = AutoConfig.from_pretrained(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.vocab_size = hf.vocab_size
        # ---- the staging area: room for the longest sequence's blocks ----
        bs = config.block_size
        max_len = min(config.max_model_len or hf.max_position_embeddings, hf.max_position_embeddings)
        slots = transfer_blocks or -(-max_len // bs)
        shape = (slots, hf.num_hidden_layers, 2, bs, hf.num_key_value_heads, head_dim_of(hf))
        itemsize = getattr(__import__("torch"), DTYPES[config.dtype]).itemsize
        self._shm = SharedMemory(create=True, size=itemsize * slots * shape[1] * 2 * bs * shape[4] * shape[5])
        self.staging = Staging(self._shm.name, shape, DTYPES[config.dtype])
        # ---- the two workers: half the cores each ----
        cores = config.cpu_threads or os.cpu_count() or 2
        self.worker_config = replace(config, policy="chunked", cpu_threads=max(1, cores // 2))
        self._settings = {"policy": "disaggregated", "max_num_batched_tokens": config.max_num_batched_tokens,
                          "max_num_seqs": config.max_num_seqs, "max_prefill_chunk": config.max_prefill_chunk}
        # ---- requests, records, counters ----
        self.requests: dict[str, Sequence] = {}
        self.done: dict[str, Sequence] = {}
        self.max_done = 4096
        self.listeners: list = []
        self.router = _Router()
        self._steps: deque[dict] = deque()          # step records relayed, not yet returned by step()
        self._replies: dict[int, dict] = {}
        self._keys = itertools.count()
        self._ids = itertools.count()
        self.step_index = 0                          # step records relayed, both workers together
        self.counters = dict(steps=0, requests_finished=0, requests_aborted=0, requests_failed=0,
                             preemptions=0, prompt_tokens=0, output_tokens=0, kv_transfers=0, worker_restarts=0)
        self.closed = False
        # ---- start both workers; they load the model side by side ----
        self.t0 = time.perf_counter() if t0 is None else t0     # t0: another engine's, to share its clock
        self._ctx = mp.get_context("spawn")
        self.workers = {name: self._spawn(name, []) for name in WORKERS}
        self._wait_ready(load_timeout)
        self.max_model_len = min(w.info["max_model_len"] for w in self.workers.values())

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    # ---- worker processes ----
    def _spawn(self, name: str, busy_slots: list[int], restarts: int = 0) -> Handle:
        commands, results = self._ctx.Queue(), self._ctx.Queue()
        wall0 = time.time() - self.clock()          # wall time of this clock's zero
        process = self._ctx.Process(target=_worker_main, name=f"batchscope-{name}", daemon=True,
                                    args=(name, self.worker_config, self.staging, busy_slots, wall0,
                                          commands, results))
        process.start()
        return Handle(name, process, commands, results, restarts)

    def _wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while any(w.info is None for w in self.workers.values()):
            for w in self.workers.values():
                if not w.process.is_alive():
                    self.close()
                    raise RuntimeError(f"the {w.name} worker failed to start (exit code {w.process.exitcode})")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the workers did not load the model within {timeout:.0f} s")
            self._pump(0.2)

    def _send(self, name: str, *command):
        self.workers[name].commands.put(command)

    def _watch(self):
        """A worker process that died: fail its requests with the reason, start a new one."""
        for name, w in list(self.workers.items()):
            if self.closed or w.process.is_alive():
                continue
            reason = f"the {name} worker process died (exit code {w.process.exitcode}); it is being restarted"
            log.error(reason)
            for rid in [r for r, h in self.router.holder.items() if h == name]:
                self._end(self.requests[rid], "error", reason)
            if name == "decode":                     # hand-overs it never adopted: their slots are free again
                for rid in list(self.router.transfers):
                    self._send("prefill", "release", self.router.transfers.pop(rid).slots)
            busy = [s for t in self.router.transfers.values() for s in t.slots]
            w.commands.cancel_join_thread()
            self.workers[name] = self._spawn(name, busy, w.restarts + 1)
            self.counters["worker_restarts"] += 1

    def _pump(self, timeout: float) -> int:
        """Handle every message the workers have sent, waiting up to timeout for the first one."""
        handles = list(self.workers.values())
        # mp.Queue keeps its pipe's read end in _reader; waiting on it blocks without spinning
        if timeout > 0:
            wait([w.results._reader for w in handles], timeout)
        n = 0
        for w in handles:
            while True:
                try:
                    msg = w.results.get_nowait()
                except queue.Empty:
                    break
                getattr(self, "_on_" + msg[0])(w, *msg[1:])
                n += 1
        return n

    # ---- messages from the workers ----
    def _on_ready(self, w: Handle, info: dict):
        w.info = info

    def _on_out(self, w: Handle, objs: list[dict], updates: dict[str, dict]):
        for rid, update in updates.items():          # text and token times first: listeners read them
            if rid in self.requests:
                self._apply(self.requests[rid], update)
        for obj in objs:
            if obj["type"] == "step":        # one step numbering for both workers: every reader's `step`
                obj["worker_step"], obj["step"] = obj["step"], self.step_index
                w.last = obj
                self.step_index += 1
                self.counters["steps"] += 1
                self.counters["output_tokens"] += sum(i["kind"] == "decode" or bool(i.get("completes_prompt"))
                                                      for i in obj["items"])
                self._steps.append(obj)
            elif obj["req"] in self.router.ended:
                continue                             # the router told this request's end already
            elif "step" in obj:
                obj["step"] = self.step_index         # preempted: while the next relayed step was built
            elif obj["event"] == "preempted":
                self.counters["preemptions"] += 1
            self._emit(obj)

    def _apply(self, seq: Sequence, u: dict):
        seq.output_token_ids.extend(u["tokens"])
        seq.token_times.extend(u["times"])
        seq.logprobs.extend(u["logprobs"])
        seq.output_text += u["text"]
        seq.first_token_time, seq.num_cached_tokens = u["first_token_time"], u["num_cached_tokens"]
        seq.num_preemptions = u["num_preemptions"]
        if u["status"] in (Status.FINISHED, Status.ABORTED):
            seq.status, seq.finish_reason, seq.finish_time, seq.error = (u["status"], u["finish_reason"],
                                                                         u["finish_time"], u["error"])
            key = {"stop": "requests_finished", "length": "requests_finished", "error": "requests_failed"}
            self.counters[key.get(seq.finish_reason, "requests_aborted")] += 1
            self._retire(seq)

    def _on_exported(self, w: Handle, rid: str, seq: Sequence, generator_state, slots: list[int], t0: float,
                     ops: tuple):
        if rid not in self.requests:                 # ended while its KV was being copied out
            self._send("prefill", "release", slots)
            return
        self.router.holder[rid] = "decode"
        self.router.transfers[rid] = Transfer(slots, t0, ops or ())
        self._send("decode", "adopt", seq, generator_state, slots, t0)

    def _on_imported(self, w: Handle, rid: str, slots: list[int], t0: float, t1: float):
        moved = self.router.transfers.pop(rid, None)
        self._send("prefill", "release", slots)
        self.counters["kv_transfers"] += 1
        seq = self.requests.get(rid) or self.done.get(rid)
        self._emit(RequestEvent("kv_transfer", rid, seq.label if seq else rid, t1, blocks=len(slots),
                                bytes=len(slots) * w.info["bytes_per_block"], seconds=t1 - t0,
                                from_worker="prefill", to_worker="decode",
                                kv_ops=moved.kv_ops if moved and moved.kv_ops else None).to_dict())

    def _on_dropped(self, w: Handle, rid: str, slots: list[int]):
        self.router.transfers.pop(rid, None)
        self._send("prefill", "release", slots)

    def _on_reply(self, w: Handle, key: int, value: dict):
        self._replies[key] = value

    # ---- requests ----
    def add_request(self, prompt: str | None = None, messages: list[dict] | None = None,
                    prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                    label: str | None = None, request_id: str | None = None) -> str:
        self._watch()          # a worker that died while the pair was idle: replaced before this request reaches it
        ids = self.tokenize(prompt, messages, prompt_token_ids)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        rid = request_id or f"d{next(self._ids)}"     # d0, d1...: never an id of the single engine (r0, r1...)
        if rid in self.requests or rid in self.done:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, str(label) if label is not None else rid, ids, params, self.clock())
        self.requests[rid] = seq
        self.router.holder[rid] = "prefill"
        self.counters["prompt_tokens"] += len(ids)
        self._emit(RequestEvent("arrived", rid, seq.label, seq.arrival_time, prompt_len=len(ids),
                                max_tokens=params.max_tokens).to_dict())
        self._send("prefill", "add", dict(prompt_token_ids=ids, params=params, label=seq.label, request_id=rid),
                   seq.arrival_time)
        return rid

    def tokenize(self, prompt=None, messages=None, prompt_token_ids=None) -> list[int]:
        from engine.prompts import tokenize
        return tokenize(self.tokenizer, self.vocab_size, self.max_model_len, self.model_name,
                        prompt, messages, prompt_token_ids)

    def get_request(self, request_id: str) -> Sequence:
        seq = self.requests.get(request_id) or self.done.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return seq

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop a request wherever it is (prefill, hand-over, decode); its worker frees its blocks."""
        seq = self.get_request(request_id)
        if seq.is_finished:
            return False
        self._send(self.router.holder[request_id], "abort", request_id, reason)
        self._end(seq, "abort", reason)
        return True

    def _end(self, seq: Sequence, finish_reason: str, reason: str):
        """The router ends a request: an abort, or its worker died. Later word of it from a worker is dropped."""
        seq.status, seq.finish_reason, seq.finish_time, seq.error = Status.ABORTED, finish_reason, self.clock(), reason
        self.counters["requests_failed" if finish_reason == "error" else "requests_aborted"] += 1
        self.router.ended.add(seq.id)
        self._retire(seq)
        self._emit(RequestEvent("aborted", seq.id, seq.label, seq.finish_time, reason=reason).to_dict())

    def _retire(self, seq: Sequence):
        self.requests.pop(seq.id, None)
        self.router.holder.pop(seq.id, None)
        self.done[seq.id] = seq
        while len(self.done) > self.max_done:
            old = next(iter(self.done))
            del self.done[old]
            self.router.ended.discard(old)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the pump ----
    def step(self, timeout: float = 10.0) -> dict | None:
        """Relay what the workers published; return their next step record (oldest first), waiting up to
        timeout for one while requests are in flight; None when none is (or none came in time)."""
        self._watch()
        self._pump(0)
        deadline = time.monotonic() + timeout
        while not self._steps and self.requests and (left := deadline - time.monotonic()) > 0:
            self._pump(min(left, 0.25))
            self._watch()
        return self._steps.popleft() if self._steps else None

    generate = LLMEngine.generate            # the same offline loop: add them all, step until each has ended

    # ---- settings and state ----
    def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                   max_num_seqs: int | None = None, max_prefill_chunk=_UNSET):
        """Budgets for both workers (each its own step); the policy stays `disaggregated`."""
        if policy not in (None, "disaggregated"):
            raise ValueError(f"this engine runs the `disaggregated` setting only; {policy!r} needs an LLMEngine")
        s = dict(self._settings)
        for k, v in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if v is not None:
                s[k] = v
        if max_prefill_chunk is not _UNSET:
            s["max_prefill_chunk"] = max_prefill_chunk
        check_budgets(s["max_num_batched_tokens"], s["max_num_seqs"], s["max_prefill_chunk"])
        self._settings = s
        budgets = {k: v for k, v in s.items() if k != "policy"}
        for name in WORKERS:
            self._send(name, "settings", budgets)
        self._emit(PolicyEvent(self.step_index, self.clock(), **s).to_dict())

    def settings(self) -> dict:
        return dict(self._settings)

    @property
    def device(self) -> str:
        return self.workers["decode"].info["device"] if self.workers["decode"].info else self.config.device

    def worker_kv(self, timeout: float = 30.0) -> dict[str, dict]:
        """Each worker's KV blocks (free, total), staging slots and queues, asked after every command sent
        before this call (so after any abort): what the tests check that nothing leaks."""
        out, deadline = {}, time.monotonic() + timeout
        for name in ("decode", "prefill"):          # decode first: the slots it gives back reach prefill first
            key = next(self._keys)
            self._send(name, "ask", key)
            while key not in self._replies:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {name} worker did not answer")
                self._pump(0.1)
                self._watch()
            out[name] = self._replies.pop(key)
        return out

    def pause_worker(self, name: str, seconds: float):
        """Hold one worker for a while (tests use it to catch a request in the middle of a hand-over)."""
        self._send(name, "pause", seconds)

    def stats(self) -> dict:
        workers, kv = {}, [0, 0, 0]
        for name, w in self.workers.items():
            last = (w.last or {}).get("kv") or {"used": 0, "total": (w.info or {}).get("num_blocks", 0), "cached": 0}
            kv = [kv[0] + last["used"], kv[1] + last["total"], kv[2] + last["cached"]]
            workers[name] = {"pid": w.process.pid, "loading": w.info is None, "restarts": w.restarts,
                             "threads": (w.info or {}).get("threads"), "kv": last,
                             "steps": w.last["worker_step"] + 1 if w.last else 0}
        last = lambda name, k: (self.workers[name].last or {}).get(k, 0)
        return {**self.settings(), "model": self.model_name, "device": self.device, "dtype": self.config.dtype,
                "attention_backend": (self.workers["decode"].info or {}).get("attention_backend"),
                "max_model_len": self.max_model_len,
                "kv": KVState(kv[0], kv[1], kv[2], self.config.block_size).to_dict(),
                "waiting": last("prefill", "waiting"), "running": last("prefill", "running") + last("decode", "running"),
                "live_requests": len(self.requests), "step": self.step_index,
                "workers": workers, "in_transfer": len(self.router.transfers), **self.counters}

    # ---- listeners ----
    def subscribe(self, fn):
        self.listeners.append(fn)

    def unsubscribe(self, fn):
        if fn in self.listeners:
            self.listeners.remove(fn)

    def _emit(self, obj: dict):
        for fn in list(self.listeners):
            try:
                fn(copy.deepcopy(obj))               # a dict of its own each, as LLMEngine gives
            except Exception:
                log.exception("a step listener failed; it is removed")
                self.unsubscribe(fn)

    # ---- the end ----
    def close(self, timeout: float = 10.0):
        """Stop both workers and free the staging area. Requests still in flight are dropped."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers.values():
            if w.process.is_alive():
                w.commands.put(("stop",))
        for w in self.workers.values():
            w.process.join(timeout)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.commands.cancel_join_thread()
        self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> DisaggregatedEngine:
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "closed", True):
            try:
                self.close()
            except Exception:
                pass                                 # interpreter shutdown: the daemon workers end with us
