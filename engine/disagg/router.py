"""DisaggregatedEngine: prompts on one engine, replies on another, the KV cache handed over between them.

    engine = DisaggregatedEngine(EngineConfig(policy="disaggregated"))
    rid = engine.add_request(messages=[{"role": "user", "content": "Hi"}], label="Alice")
    while engine.has_unfinished():
        out = engine.step()             # StepOutputs: the next StepRecord of either worker (record["worker"]
                                        # says which) and the requests' new output (engine/protocol.py)
    engine.get_request(rid).output_text
    engine.close()

The fourth generation of LLM serving (DistServe, Splitwise, Mooncake): two worker
processes (engine/disagg/worker.py), each an LLMEngine with its own share of the
cores and its own KV cache, a prefill worker and a decode worker, talking with the
router in typed messages (engine/disagg/messages.py).

  router (here)   keeps the requests in a RequestBook as LLMEngine does, assigns
                  requests, relays records and request events, forwards an abort to
                  whichever worker holds the request, and restarts a worker process
                  that dies: its requests fail with the reason, the other worker's go on.
                  The workers die with the router, however it dies: each holds a lifeline
                  (worker.hold_lifeline), and the fork server ends when its last child does.

Both workers run the `chunked` scheduler; their step records say `policy:
"disaggregated"` and carry `worker`. The router numbers the records of both in the
order it relays them (`step`, from its StepCounter, which it may share with another
engine; `worker_step` is the worker's own count), and each worker's clock is set to
the router's at start, so all times lie on one time line. A `kv_transfer` request
event tells each hand-over (blocks, bytes, seconds).

The workers start from a fork server (a spawned interpreter where there is none), which imports the
script that started the pair anew: a script that builds a DisaggregatedEngine at its top level must do it
under `if __name__ == "__main__":`, as any multiprocessing program must.

step() is the pump of a driver loop: it relays what the workers published and
returns their next step record with the requests' new output, waiting for a record
while requests are in flight (as LLMEngine.step waits for its forward pass), and
returns None when there is neither.
"""
from __future__ import annotations

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
from engine.disagg.messages import (
    Abort,
    AbortDone,
    Add,
    Adopt,
    Ask,
    Budgets,
    Dropped,
    Exported,
    Imported,
    Out,
    Pause,
    Progress,
    Ready,
    Release,
    Reply,
    Stop,
)
from engine.disagg.worker import Staging, worker_main
from engine.errors import SpeculationRefused
from engine.llm_engine import LLMEngine
from engine.memory import resident_bytes
from engine.outputs.records import KVState, PolicyEvent, RequestEvent
from engine.outputs.requests import Detokenizer, RequestBook, RequestFront, StepCounter, eos_ids
from engine.protocol import StepOutputs
from engine.sampling_params import SamplingParams
from engine.scheduling.sequence import Sequence, Status

log = logging.getLogger("batchscope.disagg")
WORKERS = ("prefill", "decode")
_UNSET = object()


def worker_context(*objects):
    """How worker processes start. A freshly spawned interpreter imports torch, transformers and the
    engine again for every worker, twice per pair, again for each restart (docs/results.md). Where the
    platform has one, a fork server imports them once, when the first pair starts (the engine, and the
    modules that define `objects`: the router's own config and tokenizer of the model served), and forks
    each worker from there. It never runs a model or touches a GPU, so its children start clean. Elsewhere
    (Windows) workers are spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["engine.disagg.worker", "transformers.models.auto.tokenization_auto",
                                *(type(o).__module__ for o in objects)])   # no effect once it runs
    return ctx


# ================= the router, in the caller's process =================
@dataclass
class Handle:
    """A worker process as the router sees it."""
    name: str
    process: mp.Process
    commands: mp.Queue
    results: mp.Queue
    lifeline: object                         # the write end of the worker's lifeline (worker.hold_lifeline)
    restarts: int = 0
    info: dict | None = None                 # its Ready message: pid, threads, blocks; None while loading
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
    aborting: dict[str, str] = field(default_factory=dict)        # aborted request -> the worker yet to answer
    unreported: set[str] = field(default_factory=set)             # sent to prefill after its last step record


class DisaggregatedEngine(RequestFront):
    def __init__(self, config: EngineConfig | None = None, transfer_blocks: int | None = None,
                 load_timeout: float = 300.0, t0: float | None = None, steps: StepCounter | None = None,
                 **overrides):
        """t0, steps: another engine's clock zero and step counter, to share its time line and numbering."""
        config = replace(config, **overrides) if config else EngineConfig(**overrides)
        self.config = config = replace(config, policy="disaggregated")
        if config.speculative_config is not None:
            raise SpeculationRefused()
        from transformers import AutoConfig

        from engine.models.llama import head_dim_of
        from engine.weights.loader import resolve_model, tokenizer
        folder = resolve_model(config.model)
        hf = AutoConfig.from_pretrained(folder)
        self.tokenizer = tokenizer(folder)
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.eos_token_ids = eos_ids(hf, self.tokenizer, folder)
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
        # the workers' caches stay lazily zeroed: the pair serves one lesson at a time, then stops
        self.worker_config = replace(config, policy="chunked", cpu_threads=max(1, cores // 2), claim_kv_cache=False)
        self._settings = {"policy": "disaggregated", "max_num_batched_tokens": config.max_num_batched_tokens,
                          "max_num_seqs": config.max_num_seqs, "max_prefill_chunk": config.max_prefill_chunk}
        # ---- requests (d0, d1...: never an id of the single engine, r0, r1...), records, counters ----
        self.t0 = time.perf_counter() if t0 is None else t0
        self.book = RequestBook(Detokenizer(self.tokenizer).token_text, id_prefix="d",
                                extra_counters=("kv_transfers", "worker_restarts"))
        self.counters = self.book.counters
        self.steps = steps or StepCounter()          # step records relayed, both workers together
        self.router = _Router()
        self._steps: deque[dict] = deque()          # step records relayed, not yet returned by step()
        self._replies: dict[int, dict] = {}
        self._keys = itertools.count()
        self.handlers = {Ready: self._on_ready, Out: self._on_out, Exported: self._on_exported,
                         Imported: self._on_imported, Dropped: self._on_dropped, AbortDone: self._on_abort_done,
                         Reply: self._on_reply}
        self.closed = False
        # ---- start both workers; they load the model side by side ----
        self._ctx = worker_context(hf, self.tokenizer)
        self.workers = {name: self._spawn(name, []) for name in WORKERS}
        self._wait_ready(load_timeout)
        self.max_model_len = min(w.info["max_model_len"] for w in self.workers.values())

    # ---- worker processes ----
    def _spawn(self, name: str, busy_slots: list[int], restarts: int = 0) -> Handle:
        commands, results = self._ctx.Queue(), self._ctx.Queue()
        # the worker's lifeline: it ends itself when this write end closes, which the kernel does when this
        # process dies, whatever kills it; the pipe is not inherited by anything this process execs
        lifeline_r, lifeline_w = self._ctx.Pipe(duplex=False)
        wall0 = time.time() - self.clock()          # wall time of this clock's zero
        process = self._ctx.Process(target=worker_main, name=f"batchscope-{name}", daemon=True,
                                    args=(dict(os.environ), lifeline_r, name, self.worker_config, self.staging,
                                          busy_slots, wall0, commands, results))
        process.start()
        lifeline_r.close()                          # only the worker reads it
        return Handle(name, process, commands, results, lifeline_w, restarts)

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

    def _send(self, name: str, command):
        self.workers[name].commands.put(command)

    def _watch(self):
        """A worker process that died: fail its requests with the reason, start a new one."""
        for name, w in list(self.workers.items()):
            if self.closed or w.process.is_alive():
                continue
            reason = f"the {name} worker process died (exit code {w.process.exitcode}); it is being restarted"
            log.error(reason)
            for rid in [r for r, h in self.router.holder.items() if h == name]:
                self._end(self.book.live[rid], "error", reason)
            for rid in [r for r, h in self.router.aborting.items() if h == name]:
                del self.router.aborting[rid]        # a dead worker answers nothing
            if name == "decode":                     # hand-overs it never adopted: their slots are free again
                for rid in list(self.router.transfers):
                    self._send("prefill", Release(self.router.transfers.pop(rid).slots))
            busy = [s for t in self.router.transfers.values() for s in t.slots]
            w.commands.cancel_join_thread()
            w.lifeline.close()
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
                self.handlers[type(msg)](w, msg)
                n += 1
        return n

    # ---- messages from the workers ----
    def _on_ready(self, w: Handle, m: Ready):
        w.info = m.info

    def _on_out(self, w: Handle, m: Out):
        for rid, progress in m.progress.items():     # text and token times first: listeners read them
            if rid in self.book.live:
                self._apply(self.book.live[rid], progress)
        for obj in m.records:
            if obj["type"] == "step":        # one step numbering for both workers: every reader's `step`
                obj["worker_step"], obj["step"] = obj["step"], self.steps.take()
                w.last = obj
                if w.name == "prefill":
                    self.router.unreported.clear()   # its queue as this record says (a request in flight
                                                     # meanwhile is missed for a step: never counted twice)
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
            self.book.emit(obj)

    def _apply(self, seq: Sequence, p: Progress):
        seq.output_token_ids.extend(p.tokens)
        seq.token_times.extend(p.times)
        seq.logprobs.extend(p.logprobs)
        seq.output_text += p.text
        seq.first_token_time, seq.num_cached_tokens = p.first_token_time, p.num_cached_tokens
        seq.num_preemptions = p.num_preemptions
        if p.status in (Status.FINISHED, Status.ABORTED):
            self._retire(seq, p.status, p.finish_reason, p.error, p.finish_time)

    def _on_exported(self, w: Handle, m: Exported):
        rid = m.seq.id
        if rid not in self.book.live:                # ended while its KV was being copied out
            self._send("prefill", Release(m.slots))
            return
        self.router.holder[rid] = "decode"
        self.router.transfers[rid] = Transfer(m.slots, m.t0, m.kv_ops)
        self._send("decode", Adopt(m.seq, m.generator_state, m.slots, m.t0))

    def _on_imported(self, w: Handle, m: Imported):
        moved = self.router.transfers.pop(m.request_id, None)
        self._send("prefill", Release(m.slots))
        self.counters["kv_transfers"] += 1
        try:
            label = self.book.get(m.request_id).label
        except KeyError:
            label = m.request_id
        self.book.emit(RequestEvent("kv_transfer", m.request_id, label, m.t1, blocks=len(m.slots),
                                    bytes=len(m.slots) * w.info["bytes_per_block"], seconds=m.t1 - m.t0,
                                    from_worker="prefill", to_worker="decode",
                                    kv_ops=moved.kv_ops if moved and moved.kv_ops else None))

    def _on_dropped(self, w: Handle, m: Dropped):
        self.router.transfers.pop(m.request_id, None)
        self._send("prefill", Release(m.slots))

    def _on_abort_done(self, w: Handle, m: AbortDone):
        self.router.aborting.pop(m.request_id, None)

    def _on_reply(self, w: Handle, m: Reply):
        self._replies[m.key] = m.value

    # ---- requests ----
    def add_request(self, prompt: str | None = None, messages: list[dict] | None = None,
                    prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                    label: str | None = None, request_id: str | None = None) -> str:
        self._watch()          # a worker that died while the pair was idle: replaced before this request reaches it
        seq = self.book.admit(self.tokenize(prompt, messages, prompt_token_ids), params, label, request_id,
                              self.clock())
        self.router.holder[seq.id] = "prefill"
        self.router.unreported.add(seq.id)
        self.book.arrived(seq)
        self._send("prefill", Add(dict(prompt_token_ids=seq.prompt_token_ids, params=seq.params, label=seq.label,
                                       request_id=seq.id), seq.arrival_time))
        return seq.id

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop a request wherever it is (prefill, hand-over, decode); its worker frees its blocks."""
        seq = self.book.get(request_id)
        if seq.is_finished:
            return False
        holder = self.router.holder[request_id]
        self._send(holder, Abort(request_id, reason))
        self.router.aborting[request_id] = holder       # busy until it answers: an export may be on its way
        self._end(seq, "abort", reason)
        return True

    def _end(self, seq: Sequence, finish_reason: str, reason: str):
        """The router ends a request: an abort, or its worker died. Later word of it from a worker is dropped."""
        self.router.ended.add(seq.id)
        self._retire(seq, Status.ABORTED, finish_reason, reason, self.clock())
        self.book.emit(RequestEvent("aborted", seq.id, seq.label, seq.finish_time, reason=reason,
                                    finish_reason=finish_reason))

    def _retire(self, seq: Sequence, status: Status, finish_reason: str, error: str | None, t: float):
        self.router.holder.pop(seq.id, None)
        self.router.unreported.discard(seq.id)
        for old in self.book.end(seq, status, finish_reason, error, t):
            self.router.ended.discard(old)

    def has_unfinished(self) -> bool:
        """Requests in flight, or an abort not yet answered (whatever it crossed must be read first: a
        hand-over's staging slots are given back only then)."""
        return bool(self.book.live or self.router.aborting)

    # ---- the pump ----
    def step(self, timeout: float = 10.0) -> StepOutputs | None:
        """Relay what the workers published; return their next step record (oldest first), waiting up to
        timeout for one while requests are in flight, and every request's new output. None when there is
        neither (nothing in flight, or nothing came in time)."""
        self._watch()
        self._pump(0)
        deadline = time.monotonic() + timeout
        while not self._steps and self.has_unfinished() and (left := deadline - time.monotonic()) > 0:
            self._pump(min(left, 0.25))
            self._watch()
        record = self._steps.popleft() if self._steps else None
        outputs = self.book.take_outputs()
        return StepOutputs(record, outputs) if record is not None or outputs else None

    generate = LLMEngine.generate            # the same offline loop: add them all, step until each has ended

    # ---- settings and state ----
    def set_policy(self, policy: str | None = None, max_num_batched_tokens: int | None = None,
                   max_num_seqs: int | None = None, max_prefill_chunk=_UNSET, speculative_config=None):
        """Budgets for both workers (each its own step); the policy stays `disaggregated`."""
        if policy not in (None, "disaggregated"):
            raise ValueError(f"this engine runs the `disaggregated` setting only; {policy!r} needs an LLMEngine")
        if speculative_config is not None:
            raise SpeculationRefused()
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
            self._send(name, Budgets(budgets))
        self.book.emit(PolicyEvent(self.step_index, self.clock(), **s))

    def settings(self) -> dict:
        return {**self._settings, "speculative_config": None}

    @property
    def device(self) -> str:
        return self.workers["decode"].info["device"] if self.workers["decode"].info else self.config.device

    def worker_kv(self, timeout: float = 30.0) -> dict[str, dict]:
        """Each worker's KV blocks (free, total), staging slots and queues, asked after every command sent
        before this call (so after any abort): what the tests check that nothing leaks."""
        out, deadline = {}, time.monotonic() + timeout
        for name in ("decode", "prefill"):          # decode first: the slots it gives back reach prefill first
            key = next(self._keys)
            self._send(name, Ask(key))
            while key not in self._replies:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {name} worker did not answer")
                self._pump(0.1)
                self._watch()
            out[name] = self._replies.pop(key)
        return out

    def pause_worker(self, name: str, seconds: float):
        """Hold one worker for a while (tests use it to catch a request in the middle of a hand-over)."""
        self._send(name, Pause(seconds))

    @property
    def num_waiting(self) -> int:
        """The prefill worker's queue as its last step record reported it, and the requests sent to it since
        (an idle worker sends no record: a burst must count at once, for the server's queue limit)."""
        return (self.workers["prefill"].last or {}).get("waiting", 0) + len(self.router.unreported)

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
                "waiting": self.num_waiting,
                "running": last("prefill", "running") + last("decode", "running"),
                "live_requests": len(self.book.live), "step": self.step_index,
                "workers": workers, "in_transfer": len(self.router.transfers), "memory": self.memory(),
                **self.counters}

    def memory(self) -> dict:
        """The router's resident bytes (it holds no KV cache) and each worker's, read from /proc by its pid
        (None while a worker loads or where there is no /proc), with the bytes of its KV cache."""
        workers = {name: {"pid": w.process.pid, "rss_bytes": resident_bytes(w.process.pid) if w.info else None,
                          "kv_cache_bytes": (w.info or {}).get("kv_cache_bytes")}
                   for name, w in self.workers.items()}
        return {"rss_bytes": resident_bytes(), "kv_cache_bytes": 0, "workers": workers}

    # ---- the end ----
    def close(self, timeout: float = 10.0):
        """Stop both workers and free the staging area. Requests still in flight are dropped."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers.values():
            if w.process.is_alive():
                w.commands.put(Stop())
        for w in self.workers.values():
            w.process.join(timeout)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.commands.cancel_join_thread()
            w.lifeline.close()
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
